"""The MoE router's expert selection in one Triton launch (CUDA, XPU; the interpreter on
the CPU): :func:`fused_topk`, the device version of
:func:`kernels.moe.reference.select_experts` that ``engine.layers.moe.triton_fused_moe``
hands to ``FusedMoE`` with the fused experts."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def route_row(logits_ptr, m, stride_lm, num_experts, TOP_K: tl.constexpr,
              RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Token ``m``'s routing from its logits row: ``(weights [BLOCK_K] fp32, ids [BLOCK_K]
    int32)``, the ``TOP_K`` largest softmax probabilities in descending order (ties to the
    lower expert id), renormalised if ``RENORM``; slots past ``TOP_K`` hold weight 0 and id
    -1. Shared by :func:`fused_topk` and the MoE decode kernels that route for themselves."""
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + m * stride_lm + offs, mask=valid, other=-float("inf"))
    x = x.to(tl.float32)
    e = tl.where(valid, tl.exp(x - tl.max(x, 0)), 0.0)
    p = tl.where(valid, e / tl.sum(e, 0), -2.0)  # padding below every probability
    kk = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.full([BLOCK_K], -1, dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)  # the lowest id among ties
        w = tl.where(kk == j, best, w)
        ids = tl.where(kk == j, idx, ids)
        p = tl.where(offs == idx, -1.0, p)  # taken
    if RENORM:
        w = w / tl.sum(w, 0)
    return w, ids


@triton.jit
def pair_expert(t, ids_ptr, logits_ptr, stride_lm, num_experts, TOP_K: tl.constexpr,
                ROUTE: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The expert (int64 scalar) of routed pair ``t`` (token ``t // TOP_K``, slot
    ``t % TOP_K``): routed here from the token's logits row if ``ROUTE`` (no routing
    launch), else read from ``ids_ptr[t]``. -1 or an id outside ``[0, num_experts)`` means
    no expert on this rank. Shared by the MoE decode kernels that run one pair a program."""
    if ROUTE:
        _, ids = route_row(logits_ptr, t // TOP_K, stride_lm, num_experts, TOP_K, RENORM,
                           BLOCK_E, BLOCK_K)
        e = tl.sum(tl.where(tl.arange(0, BLOCK_K) == t % TOP_K, ids, 0), 0).to(tl.int64)
    else:
        e = tl.load(ids_ptr + t).to(tl.int64)
    return e


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, num_experts, stride_lm,
                         TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    w, ids = route_row(logits_ptr, m, stride_lm, num_experts, TOP_K, RENORM, BLOCK_E, BLOCK_K)
    kk = tl.arange(0, BLOCK_K)
    tl.store(w_ptr + m * TOP_K + kk, w, mask=kk < TOP_K)
    tl.store(ids_ptr + m * TOP_K + kk, ids, mask=kk < TOP_K)


def fused_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernels.moe.reference.select_experts` in one Triton launch: softmax over the
    experts in fp32, the ``top_k`` largest in descending order, optionally renormalised.

    One program per token row; the top-k are ``top_k`` rounds of max + lowest index at the
    max (ties go to the lower expert id; ``torch.topk`` leaves tie order unspecified). It
    replaces the five to seven torch kernels of the reference (softmax, the top-k's gather
    and sort, the sum and the division), ~14 us per MoE layer at batch 1 on an H200
    (``bench.profile_decode`` on Qwen3-30B-A3B), with one. No host sync: graph capturable.

    Args:
        router_logits: ``[M, E]`` any float dtype, last axis unit stride, ``E <= 4096``.
        top_k: ``1 <= top_k <= E``.
        renormalize: divide the selected weights by their sum.

    Returns:
        ``(topk_weights [M, top_k] float32, topk_ids [M, top_k] int32)``.

    Raises:
        ValueError: as ``select_experts``, or ``E > 4096`` or a strided last axis.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [M, E], got {tuple(router_logits.shape)}")
    m, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if num_experts > 4096 or router_logits.stride(1) != 1:
        raise ValueError("fused_topk: needs E <= 4096 and a unit-stride last axis")
    dev = router_logits.device
    weights = torch.empty((m, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((m, top_k), dtype=torch.int32, device=dev)
    if m:
        _topk_softmax_kernel[(m,)](router_logits, weights, ids, num_experts,
                                   router_logits.stride(0), TOP_K=top_k,
                                   RENORM=bool(renormalize),
                                   BLOCK_E=triton.next_power_of_2(num_experts),
                                   BLOCK_K=triton.next_power_of_2(top_k))
    return weights, ids


__all__ = ["fused_topk", "route_row"]
