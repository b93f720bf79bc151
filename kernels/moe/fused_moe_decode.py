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

The pair (token) index is the fastest grid axis, so the programs that read one weight tile
for several pairs routed to the same expert run side by side and share it in L2. The only
workspace is ``act [M * top_k, I]``; shapes depend on M, top_k, E, H, I only: no host sync,
graph capturable. The arithmetic differs from the large-M path only in rounding (gate/up and
each routed term stay fp32 here).

``FERRY_MOE_DECODE_MAX_M`` (default 16; 0 turns the path off) is the largest M that takes it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: the largest batch that runs the two-launch decode path (environment override; 0: never)
DECODE_MAX_M = max(0, int(os.environ.get("FERRY_MOE_DECODE_MAX_M", "16")))


def use_decode_path(m: int) -> bool:
    """Whether :func:`kernels.moe.fused_moe.fused_moe` takes the decode path for M rows."""
    return 0 < m <= DECODE_MAX_M


@triton.jit
def _moe_decode_gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, H, INTER, top_k, num_experts,
                               stride_xm, stride_we, stride_wn, stride_am,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               EVEN_K: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(ids_ptr + t).to(tl.int64)
    if (e < 0) | (e >= num_experts):
        return                                   # another rank's expert: no row here
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_ld = offs_n % INTER                   # in-bounds rows; masked at the store
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (t // top_k).to(tl.int64) * stride_xm + offs_k
    g_ptrs = w_ptr + e * stride_we + offs_n_ld[:, None].to(tl.int64) * stride_wn \
        + offs_k[None, :]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
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
        acc_g += g.to(tl.float32) * x[None, :]
        acc_u += u.to(tl.float32) * x[None, :]
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    gate = tl.sum(acc_g, 1)
    up = tl.sum(acc_u, 1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + t.to(tl.int64) * stride_am + offs_n,
             act.to(act_ptr.dtype.element_ty), mask=offs_n < INTER)


@triton.jit
def _moe_decode_down_kernel(act_ptr, w_ptr, ids_ptr, tw_ptr, out_ptr, H, INTER, top_k,
                            num_experts, stride_am, stride_we, stride_wn, stride_om,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_ld = (offs_n % H).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, top_k):
        t = m * top_k + k
        e = tl.load(ids_ptr + t).to(tl.int64)
        ok = (e >= 0) & (e < num_experts)
        lim = tl.where(ok, INTER, 0)             # a dropped pair reads nothing
        wt = tl.load(tw_ptr + t)
        w_rows = w_ptr + tl.where(ok, e, 0) * stride_we + offs_n_ld[:, None] * stride_wn
        for k0 in range(0, INTER, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < lim
            a = tl.load(act_ptr + t * stride_am + kk, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * (a * wt)[None, :]
    tl.store(out_ptr + m * stride_om + offs_n, tl.sum(acc, 1).to(out_ptr.dtype.element_ty),
             mask=offs_n < H)


def _column_block(rows_of_programs: int, n: int, target: int) -> int:
    """The widest column block in (64, 32, 16) that still gives ``target`` programs."""
    for bn in (64, 32):
        if rows_of_programs * triton.cdiv(n, bn) >= target:
            return bn
    return 16


#: programs each launch aims for (a few per SM of a large GPU)
TARGET_PROGRAMS = 512


def fused_moe_decode(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """The decode path of :func:`kernels.moe.fused_moe.fused_moe` (already checked there):
    ``out[m] = sum_k topk_weights[m, k] * w2[e] @ (silu(w1[e] x_m) * (w3[e] x_m))``.

    Args:
        hidden_states: ``[M, H]`` fp16/bf16/fp32, unit last stride.
        w13: ``[E, 2I, H]``; w2: ``[E, H, I]`` (unit last stride, the activations' dtype).
        topk_weights: ``[M, top_k]`` fp32 contiguous; topk_ids: ``[M, top_k]`` int32/int64
            contiguous (ids outside ``[0, E)`` contribute nothing).
        out: ``[M, H]`` in the activations' dtype, unit last stride; written and returned.

    Two launches, one ``[M * top_k, I]`` workspace, no host sync.
    """
    m, top_k = topk_ids.shape
    num_experts, two_i, h = w13.shape
    inter = two_i // 2
    num_pairs = m * top_k
    act = torch.empty((num_pairs, inter), dtype=hidden_states.dtype,
                      device=hidden_states.device)
    bn = _column_block(num_pairs, inter, TARGET_PROGRAMS)
    bk = 128 if bn <= 32 else 64
    _moe_decode_gate_up_kernel[(num_pairs, triton.cdiv(inter, bn))](
        hidden_states, w13, topk_ids, act, h, inter, top_k, num_experts,
        hidden_states.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, EVEN_K=h % bk == 0, num_warps=4)
    bn = _column_block(m, h, TARGET_PROGRAMS)
    _moe_decode_down_kernel[(m, triton.cdiv(h, bn))](
        act, w2, topk_ids, topk_weights, out, h, inter, top_k, num_experts, act.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0), BLOCK_N=bn, BLOCK_K=128 if bn <= 32 else 64,
        num_warps=4)
    return out


__all__ = ["DECODE_MAX_M", "fused_moe_decode", "use_decode_path"]
