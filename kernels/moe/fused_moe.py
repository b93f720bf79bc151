"""Fused mixture-of-experts (MoE) experts in Triton: alignment + two grouped GEMMs.

Semantics: :mod:`kernels.moe.reference` (``fused_moe_torch``, the CPU path, and
``select_experts``, the router). ``w13`` is ``[E, 2I, H]`` with the gate rows (w1) first and
the up rows (w3) second, as SGLang and vLLM stack them; ``w2`` is ``[E, H, I]``.

Algorithm (the design of vLLM's ``fused_moe.py`` / SGLang's ``fused_moe_triton``, written
from scratch here), for T = M * top_k routed ``(token, k)`` pairs, pair index
``t = m * top_k + k``:

1. Alignment (:func:`moe_align_block_size`): the pairs are sorted by expert (stable: by pair
   index within an expert) and each expert's segment is padded to a multiple of
   ``BLOCK_SIZE_M``, so every ``BLOCK_SIZE_M`` block of the sorted list belongs to one
   expert. Two small Triton kernels, a counting sort: per chunk of pairs, a per-expert count;
   then per chunk, the offsets (prefix sums over experts and over earlier chunks) and the
   scatter; the first program also writes the padding, the block-to-expert table and the
   padded length. Buffers have the static bound of :func:`kernels.moe.reference.align_capacity`
   (``T + min(E, T) * (BLOCK_SIZE_M - 1)``), so there is no host sync and no data-dependent
   shape: the op can be captured in a CUDA/XPU graph. H200, graph replays: 6-8 us at decode
   sizes, 14-40 us at M = 4096; the torch-ops version (``align="torch"``, a stable sort and
   scatters) took 68-157 us, so the Triton one is the default.
2. Grouped GEMM (:func:`invoke_moe_gemm`), one program per (block of sorted rows, block of
   N): it loads its block's expert id, returns at once past the padded length, gathers the A
   rows by pair (token ``t // top_k`` for the gate/up GEMM, pair ``t`` for the down GEMM),
   multiplies by ``w[e]^T`` tile by tile with fp32 accumulation, optionally scales each row
   by its routed weight, and writes row ``t`` of a ``[T, N]`` output. Program ids are
   grouped ``GROUP_SIZE_M`` blocks of rows at a time so neighbouring programs share weight
   tiles in L2. Used twice: ``hidden @ w13^T -> [T, 2I]``, SwiGLU
   (:func:`kernels.fused_ops.silu_and_mul`) ``-> [T, I]``, ``@ w2^T`` times the routed
   weight ``-> [T, H]``.
3. Sum over top-k (:func:`moe_sum`): ``out[m] = sum_k buf[m * top_k + k]`` in fp32 in a fixed
   order (deterministic: no atomics), skipping pairs whose expert id is outside ``[0, E)``.

Launch configurations: :mod:`kernels.moe.moe_config` (tuned tables per device name, default
heuristic). Nothing keys off a CUDA compute capability; the same code runs on CUDA, XPU and
in the Triton interpreter (where a bf16 ``tl.dot`` is unreliable: the tests use fp16/fp32
there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_ops import silu_and_mul
from kernels.moe.fused_moe_decode import fused_moe_decode, use_decode_path
from kernels.moe.moe_config import check_config, get_moe_config
from kernels.moe.reference import (
    _check_align_args,
    align_capacity,
    check_moe_shapes,
    moe_align_block_size_torch,
    select_experts,
)

# ---------------------------------------------------------------------------- alignment


@triton.jit
def _moe_count_kernel(ids_ptr, partial_ptr, num_pairs, num_experts,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """partial[c, e] = pairs of chunk c routed to expert e (ids outside [0, E) count nowhere)."""
    c = tl.program_id(0)
    offs = c * BLOCK_T + tl.arange(0, BLOCK_T)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    hit = (ids[:, None] == e[None, :]) & (e[None, :] < num_experts)
    tl.store(partial_ptr + c * BLOCK_E + e, tl.sum(hit.to(tl.int32), 0))


@triton.jit
def _moe_scatter_kernel(ids_ptr, partial_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                        num_pairs, num_experts, num_chunks, capacity, num_blocks,
                        BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr):
    c = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)     # pairs per expert, all chunks
    before = tl.zeros([BLOCK_E], dtype=tl.int32)    # pairs per expert in chunks < c
    for c0 in range(0, num_chunks, BLOCK_C):
        rows = c0 + tl.arange(0, BLOCK_C)
        tile = tl.load(partial_ptr + rows[:, None] * BLOCK_E + e[None, :],
                       mask=rows[:, None] < num_chunks, other=0)
        total += tl.sum(tile, 0)
        before += tl.sum(tl.where(rows[:, None] < c, tile, 0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded

    # this chunk's pairs: destination = segment start + pairs of earlier chunks + rank here
    offs = c * BLOCK_T + tl.arange(0, BLOCK_T)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    valid = (ids >= 0) & (ids < num_experts) & (offs < num_pairs)
    hit = ((ids[:, None] == e[None, :]) & valid[:, None]).to(tl.int32)
    rank = tl.cumsum(hit, 0) - 1
    dest = tl.sum(hit * (rank + (start + before)[None, :]), 1)
    tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=valid)

    if c == 0:
        num_post = tl.sum(padded, 0)
        tl.store(num_post_ptr, num_post)
        # padding of each expert's segment: [start + total, end)
        j = tl.arange(0, BLOCK_M)
        pad = (start + total)[:, None] + j[None, :]
        tl.store(sorted_ptr + pad, num_pairs, mask=pad < end[:, None])
        # unused tail [num_post, capacity)
        for p0 in range(num_post // BLOCK_B * BLOCK_B, capacity, BLOCK_B):
            p = p0 + tl.arange(0, BLOCK_B)
            tl.store(sorted_ptr + p, num_pairs, mask=(p >= num_post) & (p < capacity))
        # block b starts at b * BLOCK_M; its expert is the number of segments ending at or
        # before that (end is non-decreasing); blocks past the padded length get -1
        for b0 in range(0, num_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            first = b * BLOCK_M
            ended = (end[None, :] <= first[:, None]) & (e[None, :] < num_experts)
            ex = tl.sum(ended.to(tl.int32), 1)
            ex = tl.where(first < num_post, ex, -1)
            tl.store(expert_ids_ptr + b, ex, mask=b < num_blocks)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the routed ``(token, k)`` pairs by expert, padded per expert to ``block_m``.

    Definition of the outputs (T = ``topk_ids.numel()``, pair ``t = m * top_k + k``,
    ``cap = align_capacity(T, E, block_m)``, a multiple of ``block_m``):

    * ``sorted_token_ids [cap]`` int32: expert 0's pairs in increasing ``t``, then padding up
      to a multiple of ``block_m``, then expert 1's, ... (an expert without pairs takes no
      room). Padding, and everything from ``num_tokens_post_padded`` on, is the sentinel
      ``T``. Pairs whose expert id is outside ``[0, E)`` appear nowhere.
    * ``expert_ids [cap // block_m]`` int32: the expert of each block of ``block_m`` entries;
      ``-1`` for the blocks at or past ``num_tokens_post_padded``.
    * ``num_tokens_post_padded [1]`` int32: ``sum_e ceil(count_e / block_m) * block_m``.

    Two Triton launches, no host sync, sizes from shapes only (graph capturable).
    Source: vLLM/SGLang ``moe_align_block_size`` (their CUDA kernel; a Triton counting sort
    here). :func:`kernels.moe.reference.moe_align_block_size_torch` is the torch-ops version.

    Args:
        topk_ids: ``[M, top_k]`` (any shape) int32/int64 expert ids, on the device.
        block_m: ``BLOCK_SIZE_M`` of the GEMM, a power of two >= 16.
        num_experts: E.

    Returns:
        ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``.

    Raises:
        ValueError: bad ``block_m``/``num_experts``, or non-integer ids.
    """
    _check_align_args(block_m, num_experts)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs = ids.numel()
    cap = align_capacity(num_pairs, num_experts, block_m)
    num_blocks = cap // block_m
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    if num_pairs == 0:
        num_post.zero_()
        return sorted_ids, expert_ids, num_post
    block_e = max(16, triton.next_power_of_2(num_experts))
    # one-hot tiles of BLOCK_T x BLOCK_E int32 (16k elements: 64 per thread with 8 warps)
    block_t = max(16, min(triton.next_power_of_2(num_pairs), 1024, 16384 // block_e))
    num_chunks = triton.cdiv(num_pairs, block_t)
    warps = 8 if block_t * block_e >= 8192 else 4
    partial = torch.empty((num_chunks, block_e), dtype=torch.int32, device=dev)
    _moe_count_kernel[(num_chunks,)](ids, partial, num_pairs, num_experts,
                                     BLOCK_T=block_t, BLOCK_E=block_e, num_warps=warps)
    _moe_scatter_kernel[(num_chunks,)](
        ids, partial, sorted_ids, expert_ids, num_post, num_pairs, num_experts, num_chunks,
        cap, num_blocks, BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_C=max(1, min(triton.next_power_of_2(num_chunks), 8192 // block_e)),
        BLOCK_B=max(16, min(triton.next_power_of_2(num_blocks), 8192 // block_e)),
        num_warps=warps)
    return sorted_ids, expert_ids, num_post

# ---------------------------------------------------------------------------- grouped GEMM


@triton.jit
def grouped_block_ids(N, BLOCK_N: tl.constexpr, num_m_blocks, group_m):
    """This program's ``(row block, column block)`` in grouped order: ``group_m`` row blocks
    sweep every column block before moving on (shared by the grouped MoE GEMMs)."""
    pid = tl.program_id(0)
    per_group = group_m * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * group_m
    group_size = tl.minimum(num_m_blocks - first_m, group_m)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                     N, K, num_pairs, a_row_div, num_m_blocks, group_m,
                     stride_am, stride_be, stride_bn, stride_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    pid_m, pid_n = grouped_block_ids(N, BLOCK_N, num_m_blocks, group_m)

    num_post = tl.load(num_post_ptr)
    if pid_m * BLOCK_M >= num_post:
        return                                   # past the padded length: nothing to do
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs                    # padding rows hold the sentinel num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    a_row = pair // a_row_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_ld = offs_n % N                       # in-bounds weight rows; masked at the store
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n_ld[None, :].to(tl.int64) * stride_bn \
        + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        w = tl.load(w_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n[None, :] < N))


def invoke_moe_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor,
                    topk_weights: torch.Tensor | None, sorted_token_ids: torch.Tensor,
                    expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor,
                    a_row_div: int, config: dict) -> torch.Tensor:
    """One grouped GEMM over the aligned pairs: ``c[t] = a[t // a_row_div] @ w[e_t]^T``
    (times ``topk_weights.flatten()[t]`` when given) for every pair ``t`` in
    ``sorted_token_ids``; rows of ``c`` of dropped pairs are left untouched.

    Args:
        a: ``[rows, K]`` activations (last axis unit stride): ``[M, H]`` with
            ``a_row_div = top_k`` for gate/up, ``[T, I]`` with ``a_row_div = 1`` for down.
        w: ``[E, N, K]`` expert weights, a's dtype, last axis unit stride.
        c: ``[T, N]`` output (unit last stride), written in its dtype.
        topk_weights: ``[M, top_k]`` fp32 contiguous, or None (no scaling).
        sorted_token_ids, expert_ids, num_tokens_post_padded: from
            :func:`moe_align_block_size` with ``config["BLOCK_SIZE_M"]``.
        config: see :mod:`kernels.moe.moe_config`.

    Returns:
        ``c``.
    """
    cfg = check_config(config)
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    n, k = w.shape[1], w.shape[2]
    num_m_blocks = sorted_token_ids.shape[0] // bm
    if num_m_blocks * bm != sorted_token_ids.shape[0] or expert_ids.shape[0] != num_m_blocks:
        raise ValueError("sorted_token_ids/expert_ids do not match BLOCK_SIZE_M "
                         f"{bm}: {tuple(sorted_token_ids.shape)}, {tuple(expert_ids.shape)}")
    if a.stride(1) != 1 or w.stride(2) != 1 or c.stride(1) != 1:
        raise ValueError("invoke_moe_gemm: a, w and c need a unit-stride last axis")
    grid = (num_m_blocks * triton.cdiv(n, bn),)
    _moe_gemm_kernel[grid](
        a, w, c, topk_weights if topk_weights is not None else c, sorted_token_ids,
        expert_ids, num_tokens_post_padded, n, k, c.shape[0], a_row_div, num_m_blocks,
        cfg["GROUP_SIZE_M"], a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, MUL_ROUTED_WEIGHT=topk_weights is not None,
        EVEN_K=k % bk == 0, DOT_PREC="ieee" if a.dtype == torch.float32 else None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return c

# ---------------------------------------------------------------------------- top-k sum


@triton.jit
def _moe_sum_kernel(x_ptr, ids_ptr, out_ptr, H, top_k, num_experts, stride_om,
                    BLOCK_H: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(0, top_k):
        t = m * top_k + k
        e = tl.load(ids_ptr + t)
        lim = tl.where((e >= 0) & (e < num_experts), H, 0)   # a dropped pair reads nothing
        v = tl.load(x_ptr + t * H + offs, mask=offs < lim, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < H)


def moe_sum(buf: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
            out: torch.Tensor) -> torch.Tensor:
    """``out[m] = sum_k buf[m * top_k + k]`` over the pairs with an expert id in ``[0, E)``,
    in fp32 and in k order (deterministic), rounded once to out's dtype.

    Args:
        buf: ``[M * top_k, H]`` contiguous.  topk_ids: ``[M, top_k]`` contiguous int32/int64.
        out: ``[M, H]`` with a unit-stride last axis, written and returned.
    """
    m, top_k = topk_ids.shape
    h = buf.shape[1]
    if m and h:
        block = min(triton.next_power_of_2(h), 1024)
        _moe_sum_kernel[(m, triton.cdiv(h, block))](
            buf, topk_ids, out, h, top_k, num_experts, out.stride(0), BLOCK_H=block,
            num_warps=4 if block >= 512 else 1)
    return out

# ---------------------------------------------------------------------------- the op


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              config: dict | None = None, device_name: str | None = None,
              out: torch.Tensor | None = None, align: str = "triton",
              decode: bool | None = None) -> torch.Tensor:
    """The experts of an MoE layer in Triton (CUDA, XPU; the interpreter on the CPU):
    ``out[m] = sum_k topk_weights[m, k] * w2[e] @ (silu(w1[e] x_m) * (w3[e] x_m))`` with
    ``e = topk_ids[m, k]`` (see the module docstring for the steps).

    Args:
        hidden_states: ``[M, H]`` fp16/bf16/fp32, last axis unit stride.
        w13: ``[E, 2I, H]`` gate (w1) rows then up (w3) rows per expert, the activations'
            dtype, last axis unit stride.
        w2: ``[E, H, I]`` down projection, same dtype, last axis unit stride.
        topk_weights: ``[M, top_k]`` routed weights (used in fp32).
        topk_ids: ``[M, top_k]`` int32/int64 expert ids; a pair whose id is outside
            ``[0, E)`` contributes nothing.
        config: launch configuration (:mod:`kernels.moe.moe_config` keys); None looks it up by
            ``device_name``, E, I, H, dtype and M.
        device_name: the device's name for that lookup, as :func:`engine.device.device_name`
            gives it (the engine passes it; kernels/ does not import engine/). None: no
            table, the default heuristic.
        out: optional ``[M, H]`` output (activations' dtype, unit last stride), e.g. a
            graph's static buffer.
        align: ``"triton"`` (two launches) or ``"torch"`` (torch ops) alignment, to compare.
        decode: run :func:`kernels.moe.fused_moe_decode.fused_moe_decode` (two launches,
            no alignment) instead of the six-launch path; None: when ``M <=
            DECODE_MAX_M`` (``FERRY_MOE_DECODE_MAX_M``, default 1) and no ``config`` is
            given. ``config`` and ``align`` do not apply to it.

    Returns:
        ``out`` or a new ``[M, H]`` tensor in the activations' dtype.

    Raises:
        ValueError: bad shapes/dtypes (:func:`kernels.moe.reference.check_moe_shapes`), a bad
            ``out``, a malformed configuration or an unknown ``align``.

    Workspaces: ``[T, 2I]``, ``[T, I]`` and ``[T, H]`` in the activations' dtype
    (T = M * top_k), allocated per call (the decode path: ``[T, I]`` only). No host
    synchronisation: graph capturable.
    """
    m, h, num_experts, inter, top_k = check_moe_shapes(hidden_states, w13, w2, topk_weights,
                                                       topk_ids)
    dtype, dev = hidden_states.dtype, hidden_states.device
    if out is None:
        out = torch.empty((m, h), dtype=dtype, device=dev)
    elif out.shape != (m, h) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"fused_moe: out must be [{m}, {h}] {dtype} with a unit-stride last "
                         f"axis, got {tuple(out.shape)} {out.dtype}")
    if hidden_states.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe: hidden_states, w13 and w2 need a unit-stride last axis")
    if align not in ("triton", "torch"):
        raise ValueError(f"fused_moe: align must be 'triton' or 'torch', got {align!r}")
    if m == 0:
        return out
    topk_ids = topk_ids.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    if decode or (decode is None and config is None and use_decode_path(m)):
        return fused_moe_decode(hidden_states, w13, w2, weights, topk_ids, out)
    if config is None:
        config = get_moe_config(m, num_experts, inter, h, top_k, dtype, dev.type, device_name)
    config = check_config(config)
    aligner = moe_align_block_size if align == "triton" else moe_align_block_size_torch
    sorted_ids, expert_ids, num_post = aligner(topk_ids, config["BLOCK_SIZE_M"], num_experts)
    num_pairs = m * top_k
    gate_up = torch.empty((num_pairs, 2 * inter), dtype=dtype, device=dev)
    invoke_moe_gemm(hidden_states, w13, gate_up, None, sorted_ids, expert_ids, num_post,
                    top_k, config)
    act = silu_and_mul(gate_up)
    down = torch.empty((num_pairs, h), dtype=dtype, device=dev)
    invoke_moe_gemm(act, w2, down, weights, sorted_ids, expert_ids, num_post, 1, config)
    return moe_sum(down, topk_ids, num_experts, out)


__all__ = ["fused_moe", "invoke_moe_gemm", "moe_align_block_size", "moe_sum", "select_experts"]
