"""Mixture-of-experts in plain torch: the router's expert selection, the CPU path of the
fused MoE, and a torch version of the token-to-expert alignment.

Semantics shared with the Triton op :func:`kernels.moe.fused_moe.fused_moe` (shapes: M tokens,
H hidden size, E experts, I intermediate size per rank, K = top_k)::

    out[m] = sum_k topk_weights[m, k] * w2[e] @ (silu(w1[e] @ x[m]) * (w3[e] @ x[m])),
    e = topk_ids[m, k]

with ``w13 = [w1; w3]`` stacked per expert as ``[E, 2I, H]``: rows ``[0, I)`` are the gate
projection (``w1``, HF ``gate_proj``), rows ``[I, 2I)`` the up projection (``w3``,
``up_proj``), the order SGLang and vLLM stack them in; ``w2`` (``down_proj``) is
``[E, H, I]``. A pair ``(m, k)`` whose expert id is outside ``[0, E)`` contributes nothing
(expert parallelism marks the experts of other ranks that way).

Numerics of both paths: products accumulate in fp32; the gate/up projection and the SwiGLU
output are rounded to the activation dtype (the GPU path stores them in that dtype); each
routed term is scaled by its fp32 weight, the top-k terms are summed in fp32 and the sum is
rounded once.

This module imports no Triton, so the CPU path runs where Triton is missing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``softmax`` over all experts (in fp32), the ``top_k`` largest, and
    optionally their weights divided by their sum.

    Mixtral (HF ``MixtralSparseMoeBlock``: softmax, top-k, renormalise) and Qwen2/3-MoE
    (the same, with ``norm_topk_prob`` as ``renormalize``) route this way.

    Args:
        router_logits: ``[M, E]`` router outputs, any float dtype (upcast to fp32 first).
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the selected weights by their sum (they then sum to 1).

    Returns:
        ``(topk_weights [M, top_k] float32, topk_ids [M, top_k] int32)``, in descending
        weight order per token (ties broken as ``torch.topk`` breaks them).

    Raises:
        ValueError: ``router_logits`` not 2-D or ``top_k`` outside ``[1, E]``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [M, E], got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def select_experts_grouped(router_logits: torch.Tensor, top_k: int, *, scoring: str,
                           n_group: int = 1, topk_group: int = 1, group_score: str = "max",
                           correction_bias: torch.Tensor | None = None,
                           renormalize: bool = False, routed_scaling_factor: float = 1.0,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing: scores, a top-``topk_group`` of ``n_group`` expert groups, the
    top-k experts inside them, weights from the unbiased scores.

    DeepSeek-V2 (HF ``DeepseekV2TopkRouter``): ``scoring="softmax"``, groups ranked by
    their best expert (``group_score="max"``; ``n_group=1``: plain greedy top-k), no
    renormalisation. DeepSeek-V3 (``DeepseekV3TopkRouter``, "noaux_tc"):
    ``scoring="sigmoid"``, the choice made on ``score + correction_bias``, groups ranked by
    the sum of their two best (``group_score="top2"``), ``renormalize`` (``norm_topk_prob``:
    divided by the top-k sum + 1e-20). Both end with ``* routed_scaling_factor``.

    Args:
        router_logits: ``[M, E]`` (upcast to fp32).
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring: ``"softmax"`` or ``"sigmoid"``.
        n_group, topk_group: E splits into ``n_group`` equal groups; a token chooses among
            the experts of its best ``topk_group`` groups.
        group_score: ``"max"`` or ``"top2"`` (a group's rank).
        correction_bias: ``[E]`` added to the scores for the choice only, or None.
        renormalize, routed_scaling_factor: as above.
    Returns:
        ``(topk_weights [M, top_k] float32, topk_ids [M, top_k] int32)``.
    Raises:
        ValueError: an unknown ``scoring``/``group_score``, E not divisible by ``n_group``,
            ``top_k`` outside ``[1, E]`` or ``topk_group`` outside ``[1, n_group]``.
    """
    m, e = router_logits.shape
    if scoring not in ("softmax", "sigmoid") or group_score not in ("max", "top2"):
        raise ValueError(f"scoring {scoring!r} / group_score {group_score!r}: softmax or "
                         "sigmoid / max or top2")
    if e % n_group or not 1 <= topk_group <= n_group or not 1 <= top_k <= e:
        raise ValueError(f"{e} experts in {n_group} groups, topk_group {topk_group}, "
                         f"top_k {top_k}: inconsistent")
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        grouped = choice.view(m, n_group, e // n_group)
        rank = grouped.max(dim=-1).values if group_score == "max" \
            else grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(rank).scatter_(1, rank.topk(topk_group, dim=-1).indices, 1.0)
        keep = keep.bool().unsqueeze(-1).expand(m, n_group, e // n_group).reshape(m, e)
        # V2 zeroes the other groups' (non-negative) softmax scores, V3 masks them to -inf
        choice = choice.masked_fill(~keep, 0.0 if correction_bias is None and
                                    scoring == "softmax" else float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def check_moe_shapes(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[int, ...]:
    """Validate the operands of a fused-MoE call; returns ``(M, H, E, I, top_k)``.

    Raises:
        ValueError: wrong ranks or mismatched shapes, an odd ``w13.shape[1]``, dtypes that
            differ between the activations and the weights, a non-float activation dtype,
            non-integer ``topk_ids`` or non-float ``topk_weights``.
    """
    if hidden_states.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 \
            or topk_weights.dim() != 2 or topk_ids.dim() != 2:
        raise ValueError("fused_moe: hidden_states [M, H], w13 [E, 2I, H], w2 [E, H, I], "
                         "topk_weights and topk_ids [M, top_k] expected; got "
                         f"{tuple(hidden_states.shape)}, {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}, {tuple(topk_weights.shape)}, "
                         f"{tuple(topk_ids.shape)}")
    m, h = hidden_states.shape
    e, two_i, h13 = w13.shape
    inter = two_i // 2
    if two_i % 2 or h13 != h or tuple(w2.shape) != (e, h, inter) \
            or topk_ids.shape[0] != m or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe shape mismatch: hidden_states {tuple(hidden_states.shape)}"
                         f", w13 {tuple(w13.shape)} (want [E, 2I, {h}]), w2 "
                         f"{tuple(w2.shape)} (want [{e}, {h}, {inter}]), topk_weights "
                         f"{tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}")
    if hidden_states.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fused_moe: activations must be fp16/bf16/fp32, got "
                         f"{hidden_states.dtype}")
    if w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype:
        raise ValueError(f"fused_moe: weights ({w13.dtype}, {w2.dtype}) must have the "
                         f"activations' dtype {hidden_states.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"fused_moe: topk_ids must be int32/int64 and topk_weights float, got "
                         f"{topk_ids.dtype}, {topk_weights.dtype}")
    return m, h, e, inter, topk_ids.shape[1]


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on ``[n, 2I]`` (gate columns first, then up), in fp32:
    ``g = gate.clamp(max=limit)``, ``u = up.clamp(-limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)`` -> ``[n, I]`` fp32 (transformers'
    ``GptOssExperts._apply_gate``)."""
    inter = gate_up.shape[-1] // 2
    gate = gate_up[..., :inter].float().clamp(max=limit)
    up = gate_up[..., inter:].float().clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU on ``[n, 2I]`` (gate columns first, then up): ``gelu_tanh(gate) * up`` in fp32
    -> ``[n, I]`` fp32 (Gemma 4's experts, transformers' ``Gemma4TextExperts``)."""
    inter = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :inter].float(), approximate="tanh") * gate_up[..., inter:].float()


#: the experts' activations (``activation=`` of the fused MoE ops)
MOE_ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")


def _activate(gate_up: torch.Tensor, activation: str, alpha: float, limit: float
              ) -> torch.Tensor:
    if activation == "swiglu_oai":
        return swiglu_oai(gate_up, alpha, limit)
    if activation == "gelu_tanh":
        return gelu_tanh_and_mul(gate_up)
    if activation != "silu":
        raise ValueError(f"fused_moe: unknown activation {activation!r} "
                         f"({', '.join(MOE_ACTIVATIONS)})")
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()


def fused_moe_torch(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    activation: str = "silu", swiglu_alpha: float = 1.702,
                    swiglu_limit: float = 7.0, w13_scales: torch.Tensor | None = None,
                    w2_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer's experts in torch (ferry's CPU path; runs on any device).

    The routed ``(token, k)`` pairs are sorted by expert; each expert that has pairs runs
    one gate/up matmul on its gathered tokens (``index_select``), the activation, one down
    matmul, and its weighted rows are added into an fp32 ``[M, H]`` accumulator
    (``index_add_``). The loop over the experts present and ``tolist`` of the counts sync
    with the host, so this is not for graph capture (the Triton op is).

    Args:
        hidden_states: ``[M, H]`` fp16/bf16/fp32.
        w13: ``[E, 2I, H]``, gate rows first, then up rows; w2: ``[E, H, I]``; the
            activations' dtype. With ``w13_scales``/``w2_scales`` (MXFP4,
            :mod:`kernels.moe.mxfp4`) they are the uint8 blocks ``[E, 2I, H/32, 16]`` and
            ``[E, H, I/32, 16]``, each expert that has pairs dequantized for this call.
        topk_weights: ``[M, top_k]`` float (used in fp32).
        topk_ids: ``[M, top_k]`` int32/int64; ids outside ``[0, E)`` are skipped.
        w13_bias, w2_bias: optional ``[E, 2I]`` / ``[E, H]`` biases (gpt-oss), added to the
            expert's outputs before the activation / before the routed weight.
        activation: ``"silu"`` (SwiGLU, the default), ``"swiglu_oai"``
            (:func:`swiglu_oai` with ``swiglu_alpha``, ``swiglu_limit``) or ``"gelu_tanh"``
            (:func:`gelu_tanh_and_mul`).
        w13_scales, w2_scales: MXFP4 scales ``[E, 2I, H/32]`` / ``[E, H, I/32]`` uint8.

    Returns:
        New ``[M, H]`` tensor in the activations' dtype.

    Raises:
        ValueError: see :func:`check_moe_shapes` (:func:`kernels.moe.mxfp4.check_mxfp4` for
            MXFP4 weights), or an unknown activation.
    """
    dtype = hidden_states.dtype
    if w13_scales is not None:
        from kernels.moe.mxfp4 import dequantize_mxfp4

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (dequantize_mxfp4(w13[e], w13_scales[e], dtype),
                    dequantize_mxfp4(w2[e], w2_scales[e], dtype))

        n_e, two_i, h = w13.shape[0], w13.shape[1], hidden_states.shape[1]
        check_moe_shapes(hidden_states, torch.empty((n_e, two_i, h), dtype=dtype, device="meta"),
                         torch.empty((n_e, h, two_i // 2), dtype=dtype, device="meta"),
                         topk_weights, topk_ids)
    else:
        check_moe_shapes(hidden_states, w13, w2, topk_weights, topk_ids)

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return w13[e], w2[e]
    m, h = hidden_states.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    out = torch.zeros((m, h), dtype=torch.float32, device=hidden_states.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    pairs = torch.nonzero((flat_ids >= 0) & (flat_ids < num_experts)).squeeze(1)
    ids_sorted, perm = torch.sort(flat_ids[pairs], stable=True)
    pairs = pairs[perm]
    counts = torch.bincount(ids_sorted, minlength=num_experts).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = pairs[start:start + n]
        start += n
        tokens = torch.div(sel, top_k, rounding_mode="floor")
        x = hidden_states.index_select(0, tokens)
        w13_e, w2_e = expert(e)
        gate_up = F.linear(x, w13_e, None if w13_bias is None else w13_bias[e])  # [n, 2I]
        act = _activate(gate_up, activation, swiglu_alpha, swiglu_limit).to(dtype)
        down = F.linear(act, w2_e, None if w2_bias is None else w2_bias[e])
        out.index_add_(0, tokens, down.float() * flat_w[sel, None])
    return out.to(dtype)


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of ``sorted_token_ids`` for :func:`moe_align_block_size_torch` and the Triton
    alignment: the static upper bound ``T + min(E, T) * (block_m - 1)`` on the padded pair
    count (each expert that has pairs pads by at most ``block_m - 1``; at most ``min(E, T)``
    experts have any), rounded up to a multiple of ``block_m``. ``T = M * top_k``."""
    cap = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-cap // block_m) * block_m


def moe_align_block_size_torch(topk_ids: torch.Tensor, block_m: int, num_experts: int
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-to-expert alignment in torch ops (a stable sort by expert, then a scatter into
    per-expert segments padded to ``block_m``); the same outputs as the Triton
    :func:`kernels.moe.fused_moe.moe_align_block_size`, see there for their definition.

    No ``.item()`` and only shape-determined sizes (the counts come from ``scatter_add_``,
    not ``bincount``, whose output size depends on the data), so it is graph capturable.
    Kept as the simple alternative for benchmarks and tests; about a dozen kernel launches.

    Raises:
        ValueError: ``block_m`` not a power of two >= 16 or ``num_experts < 1``.
    """
    _check_align_args(block_m, num_experts)
    dev = topk_ids.device
    num_pairs = topk_ids.numel()
    cap = align_capacity(num_pairs, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)                 # dropped pairs sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    key_sorted, order = torch.sort(key, stable=True)
    e_sorted = key_sorted.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=dev) - cnt_start[e_sorted]
    dest = torch.where(key_sorted < num_experts, pad_start[e_sorted] + rank, cap)
    sorted_ids = torch.full((cap + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    num_post = pad_end[-1:].to(torch.int32)
    block_start = torch.arange(cap // block_m, device=dev) * block_m
    expert_ids = torch.searchsorted(pad_end, block_start, right=True)
    expert_ids = torch.where(block_start < num_post, expert_ids, -1).to(torch.int32)
    return sorted_ids[:cap], expert_ids, num_post


def _check_align_args(block_m: int, num_experts: int) -> None:
    if block_m < 16 or block_m & (block_m - 1) or num_experts < 1:
        raise ValueError(f"alignment needs block_m a power of two >= 16 and num_experts >= 1,"
                         f" got {block_m}, {num_experts}")


__all__ = ["align_capacity", "check_moe_shapes", "fused_moe_torch",
           "moe_align_block_size_torch", "select_experts", "swiglu_oai"]


def dequantize_fp8_block_experts(wq: torch.Tensor, scales: torch.Tensor, block_k: int,
                                 row_div: int, dtype: torch.dtype = torch.float32
                                 ) -> torch.Tensor:
    """Block-FP8 expert weights ``wq [E, N, K]`` e4m3 with ``scales [E, R, ceil(K/block_k)]``
    fp32 (``row_div`` weight rows per scale row) -> ``[E, N, K]`` in ``dtype``: each
    expert's :func:`kernels.fp8.reference.dequantize_weight_blocks` (what
    :mod:`kernels.moe.fused_moe_fp8` multiplies by)."""
    from kernels.fp8.reference import dequantize_weight_blocks

    return torch.stack([dequantize_weight_blocks(wq[e], scales[e], block_k, row_div).to(dtype)
                        for e in range(wq.shape[0])])
