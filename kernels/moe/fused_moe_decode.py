"""The MoE experts at decode sizes in two Triton launches (CUDA, XPU; the interpreter on the
CPU): no alignment, SwiGLU in the gate/up epilogue, the top-k sum in the down GEMM.

:func:`kernels.moe.fused_moe.fused_moe` at large M sorts the ``(token, k)`` pairs by expert
(two alignment launches), runs a grouped ``tl.dot`` GEMM for gate/up, SwiGLU, a second
grouped GEMM for down and a top-k sum: six launches per layer, each a few microseconds of
mostly idle GPU when a decode step routes one token to eight experts. At ``M <= DECODE_MAX_M``
:func:`fused_moe_decode` runs instead:

1. :func:`_moe_decode_gate_up_kernel`, one program per ``(pair t, block of I)``: loads the
   pair's expert id, the token row ``x[t // top_k]`` and the gate and up rows of
   ``w13[e]`` of its block, reduces over H in fp32 (a GEMV: a broadcast multiply and a sum,
   no ``tl.dot`` padding of one row to 16), and writes ``act[t] = silu(gate) * up`` in the
   activations' dtype. A pair whose id is outside ``[0, E)`` (another rank's expert under
   expert parallelism) returns at once.
2. :func:`_moe_decode_down_kernel`, one program per ``(token m, block of H)``: for each of
   the token's ``top_k`` pairs, ``routed weight * w2[e] @ act[t]`` summed in fp32 in k order
   (deterministic, no atomics) and written once, rounded to the output dtype; dropped pairs
   read nothing.

:func:`fused_moe_decode_routed` is the same two launches taking the router logits instead of
the routed ids and weights: every program routes its token itself
(:func:`kernels.moe.routing.route_row`, the arithmetic of ``fused_topk``), so the MoE layer
after its router GEMM is two launches in all.

The pair (token) index is the fastest grid axis, so the programs that read one weight tile
for several pairs routed to the same expert run side by side and share it in L2. The only
workspace is ``act [M * top_k, I]``; shapes depend on M, top_k, E, H, I only: no host sync,
graph capturable. The arithmetic differs from the large-M path only in rounding (gate/up and
each routed term stay fp32 here).

``FERRY_MOE_DECODE_MAX_M`` (default 1; 0 turns the path off) is the largest M that takes it:
on the H200 (2026-12-03, ``bench.kernels.bench_moe_decode``, default tiles) the experts alone
took 0.85x the grouped path's time at M = 1 for Qwen3-30B-A3B's shape and 1.09x for
Mixtral's, 1.07-1.24x at M = 4 and 1.3-2.6x at M = 16 (docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.moe.routing import pair_expert, route_row

#: the largest batch that runs the two-launch decode path (environment override; 0: never)
DECODE_MAX_M = max(0, int(os.environ.get("FERRY_MOE_DECODE_MAX_M", "1")))


def use_decode_path(m: int) -> bool:
    """Whether :func:`kernels.moe.fused_moe.fused_moe` takes the decode path for M rows."""
    return 0 < m <= DECODE_MAX_M


@triton.jit
def _moe_decode_gate_up_kernel(x_ptr, w_ptr, ids_ptr, logits_ptr, act_ptr, H, INTER,
                               num_experts, stride_xm, stride_we, stride_wn, stride_am,
                               stride_lm, TOP_K: tl.constexpr, ROUTE: tl.constexpr,
                               RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                               BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    t = tl.program_id(0)
    top_k = TOP_K
    e = pair_expert(t, ids_ptr, logits_ptr, stride_lm, num_experts, TOP_K, ROUTE, RENORM,
                    BLOCK_E, BLOCK_P)
    if (e < 0) | (e >= num_experts):
        return                                   # another rank's expert: no row here
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_ld = offs_n % INTER                   # in-bounds rows; masked at the store
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (t // top_k).to(tl.int64) * stride_xm + offs_k
    g_ptrs = w_ptr + e * stride_we + offs_n_ld[:, None].to(tl.int64) * stride_wn \
        + offs_k[None, :]
    u_ptrs = g_ptrs + INTER * stride_wn
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < H - k0
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0)
        gate += tl.sum(g.to(tl.float32) * x[None, :], 1)
        up += tl.sum(u.to(tl.float32) * x[None, :], 1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + t.to(tl.int64) * stride_am + offs_n,
             act.to(act_ptr.dtype.element_ty), mask=offs_n < INTER)


@triton.jit
def _moe_decode_down_kernel(act_ptr, w_ptr, ids_ptr, tw_ptr, logits_ptr, out_ptr, H, INTER,
                            num_experts, stride_am, stride_we, stride_wn, stride_om, stride_lm,
                            TOP_K: tl.constexpr, ROUTE: tl.constexpr, RENORM: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # all top_k pairs of the token at once: a [BLOCK_P, BLOCK_N, BLOCK_K] weight tile per
    # step (more bytes in flight than one pair after another), summed in a fixed order
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_ld = (offs_n % H).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    kp = tl.arange(0, BLOCK_P)
    t = m * TOP_K + kp
    if ROUTE:  # the token's experts and weights from its router logits
        wt, e = route_row(logits_ptr, m, stride_lm, num_experts, TOP_K, RENORM, BLOCK_E,
                          BLOCK_P)
        e = e.to(tl.int64)
        ok = (kp < TOP_K) & (e >= 0)
    else:
        e = tl.load(ids_ptr + t, mask=kp < TOP_K, other=-1).to(tl.int64)
        ok = (kp < TOP_K) & (e >= 0) & (e < num_experts)  # a dropped pair reads nothing
        wt = tl.load(tw_ptr + t, mask=ok, other=0.0)
    a_rows = act_ptr + t[:, None] * stride_am                                  # [P, 1]
    w_rows = w_ptr + tl.where(ok, e, 0)[:, None, None] * stride_we \
        + offs_n_ld[None, :, None] * stride_wn                                 # [P, N, 1]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < INTER
        a = tl.load(a_rows + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        a = a.to(tl.float32) * wt[:, None]
        w = tl.load(w_rows + kk[None, None, :], mask=ok[:, None, None] & k_ok[None, None, :],
                    other=0.0)
        acc += tl.sum(tl.sum(w.to(tl.float32) * a[:, None, :], 2), 0)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty),
             mask=offs_n < H)


#: tiles: aim for this many programs per launch (enough resident programs per SM to keep
#: the loads in flight) and this many weight elements per program and step
TARGET_PROGRAMS, TILE_ELEMS = (int(v) for v in os.environ.get(
    "FERRY_MOE_DECODE_TILES", "1024,4096").split(","))


def decode_tiles(m: int, top_k: int, h: int, inter: int, target_programs: int | None = None,
                 tile_elems: int | None = None) -> dict:
    """The decode kernels' tiles for M tokens: ``{"up": (BLOCK_N, BLOCK_K), "down":
    (BLOCK_P, BLOCK_N, BLOCK_K)}``. BLOCK_N is the widest power of two in [2, 64] that
    still gives ``target_programs`` programs (the narrowest when none does), capped so a
    step's weight tile stays near ``tile_elems`` with BLOCK_K >= 64; BLOCK_K fills the rest
    (at most the reduced dimension's power of two)."""
    target = TARGET_PROGRAMS if target_programs is None else target_programs
    elems = TILE_ELEMS if tile_elems is None else tile_elems

    def pick(rows: int, n: int, per_row: int, k: int) -> tuple[int, int]:
        bn = 2
        for cand in (64, 32, 16, 8, 4):
            if rows * triton.cdiv(n, cand) >= target:
                bn = cand
                break
        bn = max(2, min(bn, elems // (per_row * 64)))
        bk = max(64, min(triton.next_power_of_2(k), elems // (per_row * bn)))
        return bn, bk

    up_bn, up_bk = pick(m * top_k, inter, 2, h)          # gate and up rows
    bp = triton.next_power_of_2(top_k)
    down_bn, down_bk = pick(m, h, bp, inter)             # all top_k pairs at once
    return {"up": (up_bn, up_bk), "down": (bp, down_bn, down_bk)}


def fused_moe_decode(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     out: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """The decode path of :func:`kernels.moe.fused_moe.fused_moe` (already checked there):
    ``out[m] = sum_k topk_weights[m, k] * w2[e] @ (silu(w1[e] x_m) * (w3[e] x_m))``.

    Args:
        hidden_states: ``[M, H]`` fp16/bf16/fp32, unit last stride.
        w13: ``[E, 2I, H]``; w2: ``[E, H, I]`` (unit last stride, the activations' dtype).
        topk_weights: ``[M, top_k]`` fp32 contiguous; topk_ids: ``[M, top_k]`` int32/int64
            contiguous (ids outside ``[0, E)`` contribute nothing).
        out: ``[M, H]`` in the activations' dtype, unit last stride; written and returned.
        tiles: :func:`decode_tiles`'s dict (default: its choice for these shapes).

    Two launches, one ``[M * top_k, I]`` workspace, no host sync.
    """
    m, top_k = topk_ids.shape
    return _launch(hidden_states, w13, w2, m, top_k, out, tiles, (topk_ids, topk_weights))


def fused_moe_decode_routed(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                            router_logits: torch.Tensor, top_k: int, renormalize: bool,
                            out: torch.Tensor | None = None,
                            tiles: dict | None = None) -> torch.Tensor:
    """:func:`kernels.moe.routing.fused_topk` and :func:`fused_moe_decode` in two launches:
    each program routes its token from the router logits itself (softmax, top-k with ties to
    the lower id, optional renormalisation: the same arithmetic as ``fused_topk``), so the
    routing launch and the ``[M, top_k]`` weights and ids are gone.

    Args:
        hidden_states: ``[M, H]``; w13: ``[E, 2I, H]``; w2: ``[E, H, I]`` (as
            :func:`kernels.moe.fused_moe.fused_moe`; all E experts on this rank).
        router_logits: ``[M, E]`` any float dtype, unit last stride, ``E <= 4096``.
        top_k: ``1 <= top_k <= E``.  renormalize: divide the top-k weights by their sum.
        out: optional ``[M, H]`` output in the activations' dtype.

    Returns:
        ``out`` or a new ``[M, H]`` tensor.

    Raises:
        ValueError: logits not ``[M, E]`` for the weights' E, a strided last axis, E > 4096,
            or a bad ``top_k``.
    """
    m, h = hidden_states.shape
    num_experts = w13.shape[0]
    if router_logits.shape != (m, num_experts) or router_logits.stride(1) != 1 \
            or num_experts > 4096:
        raise ValueError(f"router_logits must be [{m}, {num_experts}] with a unit-stride last "
                         f"axis and E <= 4096, got {tuple(router_logits.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if out is None:
        out = torch.empty((m, h), dtype=hidden_states.dtype, device=hidden_states.device)
    if m == 0:
        return out
    return _launch(hidden_states, w13, w2, m, top_k, out, tiles, None,
                   (router_logits, bool(renormalize)))


def _launch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, m: int, top_k: int,
            out: torch.Tensor, tiles: dict | None, routed: tuple | None,
            route: tuple | None = None) -> torch.Tensor:
    """The two launches: ``routed`` = (ids, weights) given, or ``route`` = (logits,
    renormalize) to route inside the kernels."""
    num_experts, two_i, h = w13.shape
    inter = two_i // 2
    num_pairs = m * top_k
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    # tiles of M's power-of-two bucket (the decode graphs' batch sizes up to 16): an eager
    # step of M rows and the graph replay of its padded bucket then sum every real row in the
    # same K blocks, bit for bit (engine/executor/graph_setup.py compares the two)
    t = tiles or decode_tiles(triton.next_power_of_2(m), top_k, h, inter)
    if route is None:
        ids, weights = routed
        logits, renorm, stride_lm = ids, False, 0      # logits unused
    else:
        ids = weights = None
        logits, renorm = route
        stride_lm = logits.stride(0)
    common = dict(TOP_K=top_k, ROUTE=route is not None, RENORM=renorm,
                  BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4)
    bp = triton.next_power_of_2(top_k)
    bn, bk = t["up"]
    _moe_decode_gate_up_kernel[(num_pairs, triton.cdiv(inter, bn))](
        x, w13, ids if ids is not None else logits, logits, act, h, inter, num_experts,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), stride_lm,
        BLOCK_P=bp, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=h % bk == 0, **common)
    down_bp, bn, bk = t["down"]
    _moe_decode_down_kernel[(m, triton.cdiv(h, bn))](
        act, w2, ids if ids is not None else logits,
        weights if weights is not None else logits, logits, out, h, inter, num_experts,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), stride_lm,
        BLOCK_P=max(bp, down_bp), BLOCK_N=bn, BLOCK_K=bk, **common)
    return out


__all__ = ["DECODE_MAX_M", "decode_tiles", "fused_moe_decode", "fused_moe_decode_routed",
           "use_decode_path"]
