"""Batched LoRA for mixed-adapter batches: segmented shrink and expand (Triton) and a torch path.

A LoRA adapter adds ``scale * B (A x)`` to a linear layer's output (Hu et al. 2021, "LoRA:
Low-Rank Adaptation of Large Language Models"). A batch mixes requests of several adapters
(and of the base model), so the rows of ``x [T, K]`` are cut into *segments*: runs of rows
that use one adapter slot (a prefill request's new tokens are one segment, a decode request is
a segment of one row). Every adapter lives in one slot of stacked buffers

    A [S, R, K]   the slot's ``lora_A`` rows (rank r <= R, rows past r are zero)
    B [S, R, N]   the slot's ``lora_B`` transposed (scale folded in; rows past r are zero)

so a graph captured once reads any mix of adapters through the segment arrays (device
tensors: ``seg_start``, ``seg_len``, ``seg_slot`` [G] int32; slot -1 = the base model, no
delta). This is the segmented-GEMM scheme of Punica (Chen et al. 2023, SGMV) and of SGLang's
chunked SGMV backend, written here from that description:

- :func:`lora_shrink`: ``s[rows of g] = x[rows of g] @ A[slot g]^T`` -> ``[split, T, P*R]``
  fp32 partial sums over K chunks (split-K for decode's few rows);
- :func:`lora_expand`: ``y[rows of g, y_off:y_off+N] += s[rows of g, s_off:s_off+R] @
  B[slot g]``, in place, in y's dtype.

A fused projection (q/k/v, gate/up) has P parts: ``A [P, S, R, K]`` (one shrink writes the
P*R columns of ``s``, part p's at [p*R, (p+1)*R)) and ``B [S, R, N_total]`` with the parts'
columns side by side; one expand covers all parts when its column tile divides the part
boundaries (a tile reads the R columns of ``s`` of its part), else one expand per part:
2 launches per projection, 8 per Llama layer. With ``FERRY_LORA_FUSED_DECODE=1`` a decode
step (every segment one row) runs :func:`lora_decode_fused` instead: shrink and expand of all
parts in one launch (a projection whose K exceeds ``FUSED_MAX_K`` keeps two), 5 per
Llama-3-8B layer. It is off by default: on the H200 (2026-12-04, docs/benchmarks.md) the
one-launch kernel made a 4-adapter Llama-3-8B step slower, 1.35x base against 1.29x at bs1
and 2.09x against 1.44x at bs64 (each program walks all of K for its rows).

Grid: ``(segments, ceil(max_len / BLOCK_M), ceil(N / BLOCK_N))``; a program past its
segment's end or on a base segment returns at once. ``max_len`` is a host int (decode: 1).
:func:`kernels.lora.reference.lora_apply_torch` is the CPU path and the tests' second opinion.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.launch import dot_kernel_options


@triton.jit
def _segment_rows(seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M: tl.constexpr):
    """This program's rows of its segment (``program_id(0)``, row block ``program_id(1)``):
    ``(rows [BLOCK_M] int64, row mask, slot, done)``; done past the segment's end or on a
    base segment (slot < 0)."""
    g = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    seg_len = tl.load(seg_len_ptr + g)
    slot = tl.load(seg_slot_ptr + g)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    rows = (tl.load(seg_start_ptr + g) + offs_m).to(tl.int64)
    return rows, offs_m < seg_len, slot, (m0 >= seg_len) | (slot < 0)


@triton.jit
def _column_tile(pid_n, N, R, OFF1, OFF2, BLOCK_N: tl.constexpr):
    """An expand program's columns ``offs_n``, their mask, and the first column of the
    shrink output its part reads (parts start at 0, OFF1, OFF2; R columns each)."""
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    s_col = ((n0 >= OFF1).to(tl.int32) + (n0 >= OFF2).to(tl.int32)) * R
    return offs_n, offs_n < N, s_col


@triton.jit
def _add_into(y_ptr, rows, offs_n, mask, acc, stride_ym):
    """``y[rows, offs_n] += acc`` (fp32 sum, stored in y's dtype)."""
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_s(s_ptr, rows, cols, mask, NSPLIT, stride_ss, stride_sm):
    """The shrink output at ``rows`` x ``cols`` [BLOCK_M, BLOCK_K] fp32: the sum of its
    ``NSPLIT`` K-chunk partials."""
    ptrs = s_ptr + rows[:, None] * stride_sm + cols[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0)
    for i in range(1, NSPLIT):
        s += tl.load(ptrs + i * stride_ss, mask=mask, other=0.0)
    return s


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   R_ALL, R, K, K_SPLIT, stride_xm, stride_ap, stride_as, stride_ar,
                   stride_ss, stride_sm, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, mask_m, slot, done = _segment_rows(seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                                             BLOCK_M)
    if done:
        return
    # axis 2: column block x K chunk (split-K: a decode row's shrink would otherwise be one
    # program walking all of K, latency-bound)
    n_blocks = tl.cdiv(R_ALL, BLOCK_N)
    pid_n = tl.program_id(2) % n_blocks
    pid_k = tl.program_id(2) // n_blocks
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < R_ALL
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    # output column j is row j % R of part j // R
    a_rows = (offs_n // R).to(tl.int64) * stride_ap + (offs_n % R) * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < k_hi
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_base + a_rows[None, :] + kk[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    # each K chunk writes its own partial sum; the expand adds them up as it reads them
    s_ptrs = s_ptr + pid_k.to(tl.int64) * stride_ss + rows[:, None] * stride_sm \
        + offs_n[None, :]
    tl.store(s_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                   N, R, OFF1, OFF2, NSPLIT, stride_ss, stride_sm, stride_bs, stride_bk,
                   stride_ym,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rows, mask_m, slot, done = _segment_rows(seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                                             BLOCK_M)
    if done:
        return
    offs_n, mask_n, s_col = _column_tile(tl.program_id(2), N, R, OFF1, OFF2, BLOCK_N)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < R
        s = _load_s(s_ptr, rows, s_col + kk, mask_m[:, None] & mask_k[None, :], NSPLIT,
                    stride_ss, stride_sm)
        b = tl.load(b_base + kk[:, None] * stride_bk + offs_n[None, :],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(s, b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(s.to(b.dtype), b)
    _add_into(y_ptr, rows, offs_n, mask_m[:, None] & mask_n[None, :], acc, stride_ym)


@triton.jit
def _expand_rows_kernel(s_ptr, b_ptr, y_ptr, seg_start_ptr, seg_slot_ptr, G, N, R, OFF1,
                        OFF2, NSPLIT, stride_ss, stride_sm, stride_bs, stride_bk, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`lora_expand` for one-row segments (decode): a program takes BLOCK_M rows,
    each with its own slot (B gathered per row, a broadcast multiply-add over the rank
    instead of ``tl.dot``), so a batch of B rows runs ceil(B / BLOCK_M) programs per column
    tile instead of B, and a block of base rows returns at once."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(seg_slot_ptr + offs_m, mask=offs_m < G, other=-1)
    live = slot >= 0
    if tl.max(live.to(tl.int32), axis=0) == 0:
        return
    rows = tl.load(seg_start_ptr + offs_m, mask=live, other=0).to(tl.int64)
    offs_n, mask_n, s_col = _column_tile(tl.program_id(1), N, R, OFF1, OFF2, BLOCK_N)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < R
        s = _load_s(s_ptr, rows, s_col + kk, live[:, None] & mask_k[None, :], NSPLIT,
                    stride_ss, stride_sm)
        b = tl.load(b_rows[:, None, None] + kk[None, :, None] * stride_bk
                    + offs_n[None, None, :],
                    mask=live[:, None, None] & mask_k[None, :, None] & mask_n[None, None, :],
                    other=0.0)
        acc += tl.sum(s[:, :, None] * b.to(tl.float32), axis=1)
    _add_into(y_ptr, rows, offs_n, live[:, None] & mask_n[None, :], acc, stride_ym)


@triton.jit
def _decode_fused_kernel(x_ptr, a_ptr, b_ptr, y_ptr, seg_start_ptr, seg_slot_ptr, G, K, R,
                         S, OFF1, OFF2, N0, N1, N2, CHUNK, stride_xm, stride_ap, stride_as,
                         stride_ar, stride_bs, stride_bk, stride_ym, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """Shrink and expand of one part in one program for BLOCK_M one-row segments (decode):
    program (row block, part, column chunk) computes ``s = x @ A[slot, part]^T`` over all
    of K for its rows, then ``y[:, chunk] += s @ B[slot][:, chunk]``. The rows' slots are
    visited one by one (a slot no row of the block uses is skipped), so each slot's A and
    B tiles are read once per program and fed to ``tl.dot`` with the other rows masked."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(seg_slot_ptr + offs_m, mask=offs_m < G, other=-1)
    live = slot >= 0
    if tl.max(live.to(tl.int32), axis=0) == 0:
        return
    p = tl.program_id(1)
    off_p = tl.where(p == 0, 0, tl.where(p == 1, OFF1, OFF2))
    n_p = tl.where(p == 0, N0, tl.where(p == 1, N1, N2))
    col0 = tl.program_id(2) * CHUNK
    if col0 >= n_p:
        return
    col_end = tl.minimum(col0 + CHUNK, n_p)
    rows = tl.load(seg_start_ptr + offs_m, mask=live, other=0).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    offs_k = tl.arange(0, BLOCK_K)
    s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for sl in range(0, S):
        mine = slot == sl
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            a_base = a_ptr + p.to(tl.int64) * stride_ap + sl * stride_as
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                k_ok = kk < K
                # the other slots' rows load as zeros: their part of s stays untouched
                x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                            mask=mine[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(a_base + rr[None, :] * stride_ar + kk[:, None],
                            mask=r_ok[None, :] & k_ok[:, None], other=0.0)
                if IEEE:
                    s += tl.dot(x, a, input_precision="ieee")
                else:
                    s += tl.dot(x, a)
    for n0 in range(col0, col_end, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        n_ok = nn < col_end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for sl in range(0, S):
            mine = slot == sl
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                b = tl.load(b_ptr + sl * stride_bs + rr[:, None] * stride_bk + off_p
                            + nn[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
                s_sl = tl.where(mine[:, None], s, 0.0)
                if IEEE:
                    acc += tl.dot(s_sl, b.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(s_sl.to(b.dtype), b)
        _add_into(y_ptr, rows, off_p + nn, live[:, None] & n_ok[None, :], acc, stride_ym)


def _block_m(max_len: int) -> int:
    return 16 if max_len <= 16 else 32 if max_len <= 32 else 64


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


#: split-K: aim for this many shrink programs; a K chunk is at least SHRINK_MIN_CHUNK wide
SHRINK_PROGRAMS = 1024
SHRINK_MIN_CHUNK = 256

#: decode steps (one-row segments) run shrink + expand in one launch
#: (:func:`lora_decode_fused`) with ``FERRY_LORA_FUSED_DECODE=1``; off by default (slower on
#: the H200 at bs1 and bs64: module docstring)
FUSED_DECODE = os.environ.get("FERRY_LORA_FUSED_DECODE", "0") == "1"
#: the fused decode kernel's programs: about this many, over row blocks, parts and chunks
FUSED_PROGRAMS = int(os.environ.get("FERRY_LORA_FUSED_PROGRAMS", "64"))
#: the widest input the fused decode kernel takes: each of its programs walks all of K, so a
#: projection with a longer K (Llama-3-8B's down, 14,336) keeps the split-K shrink
FUSED_MAX_K = int(os.environ.get("FERRY_LORA_FUSED_MAX_K", "8192"))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg_start: torch.Tensor,
                seg_len: torch.Tensor, seg_slot: torch.Tensor, max_len: int,
                out: torch.Tensor | None = None, split_k: int | None = None) -> torch.Tensor:
    """``x [T, K] @ A[:, slot]^T`` per segment -> ``[split, T, P*R]`` float32 partial sums
    over K chunks (their sum is the product; :func:`lora_expand` adds them up).

    Args:
        x: [T, K] activations (fp16, bf16 or fp32), rows with stride 1 in K.
        a: [P, S, R, K] stacked ``lora_A`` of P parts in x's dtype (K contiguous).
        seg_start, seg_len, seg_slot: [G] int32 on x's device (slot -1: base rows).
        max_len: the longest segment (host int; a bound is enough).
        out: optional [split, T, P*R] fp32 output buffer (its split must be the one chosen).
        split_k: K chunks (default: enough for ~SHRINK_PROGRAMS programs, chunks of at least
            SHRINK_MIN_CHUNK; a decode step's few rows would otherwise walk K in one
            program each). Each chunk writes its own partial: no atomics, no zeroing.
    Returns:
        ``out``; rows of base segments are left unwritten.
    """
    t, k = x.shape
    r = a.shape[2]
    r_all = a.shape[0] * r
    if x.stride(1) != 1:
        x = x.contiguous()
    g = seg_start.shape[0]
    bm, bk = _block_m(max_len), 64
    bn = _pow2(r_all, 16, 64)
    blocks = (g, triton.cdiv(max(max_len, 1), bm), triton.cdiv(r_all, bn))
    if split_k is None:
        split_k = min(triton.cdiv(k, SHRINK_MIN_CHUNK),
                      triton.cdiv(SHRINK_PROGRAMS, blocks[0] * blocks[1] * blocks[2]))
    chunk = triton.cdiv(triton.cdiv(k, max(split_k, 1)), bk) * bk
    split_k = triton.cdiv(k, chunk)
    if out is None:
        out = torch.empty(split_k, t, r_all, dtype=torch.float32, device=x.device)
    if g == 0 or max_len <= 0:
        return out
    grid = (blocks[0], blocks[1], blocks[2] * split_k)
    _shrink_kernel[grid](x, a, out, seg_start, seg_len, seg_slot, r_all, r, k, chunk,
                         x.stride(0), a.stride(0), a.stride(1), a.stride(2), out.stride(0),
                         out.stride(1), IEEE=x.dtype == torch.float32, BLOCK_M=bm,
                         BLOCK_N=bn, BLOCK_K=bk, **dot_kernel_options(4, 2, x.device.type))
    return out


def expand_tile(part_starts: tuple[int, ...]) -> int | None:
    """The column tile (64, 32 or 16) of one expand over parts starting at ``part_starts``
    (besides 0): the largest that divides every start; None when none does."""
    for bn in (64, 32, 16):
        if all(off % bn == 0 for off in part_starts):
            return bn
    return None


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, seg_start: torch.Tensor,
                seg_len: torch.Tensor, seg_slot: torch.Tensor, max_len: int,
                part_starts: tuple[int, ...] = ()) -> torch.Tensor:
    """``y[rows] += s[rows, part's R columns] @ B[slot]`` per segment, in place (y's dtype).

    Args:
        y: [T, N] output view (row stride free, column stride 1).
        s: [split, T, P*R] float32 (:func:`lora_shrink`'s partial sums, or a view of one
            part's R columns of them).
        b: [S, R, N] stacked ``lora_B`` transposed (scale folded in), N contiguous.
        seg_start, seg_len, seg_slot, max_len: as in :func:`lora_shrink`.
        part_starts: the first columns of parts 1.. (at most 2; part p reads columns
            [p*R, (p+1)*R) of ``s``); :func:`expand_tile` must accept them.
    Raises:
        ValueError: part starts that no column tile divides, or more than 3 parts.
    """
    t, n = y.shape
    r = b.shape[1]
    g = seg_start.shape[0]
    if g == 0 or max_len <= 0:
        return y
    assert y.stride(1) == 1 and s.stride(2) == 1, "lora_expand: column stride must be 1"
    bn = expand_tile(part_starts)
    if bn is None or len(part_starts) > 2:
        raise ValueError(f"lora_expand: parts starting at {part_starts} need one call each")
    off1, off2 = (list(part_starts) + [n, n])[:2]
    if max_len == 1:  # decode: rows with their own slots, 16 to a program
        bn = min(bn, 32)
        _expand_rows_kernel[(triton.cdiv(g, 16), triton.cdiv(n, bn))](
            s, b, y, seg_start, seg_slot, g, n, r, off1, off2, s.shape[0], s.stride(0),
            s.stride(1), b.stride(0), b.stride(1), y.stride(0), BLOCK_M=16, BLOCK_N=bn,
            BLOCK_K=16, num_warps=4)
        return y
    bm = _block_m(max_len)
    grid = (g, triton.cdiv(max_len, bm), triton.cdiv(n, bn))
    _expand_kernel[grid](s, b, y, seg_start, seg_len, seg_slot, n, r, off1, off2, s.shape[0],
                         s.stride(0), s.stride(1), b.stride(0), b.stride(1), y.stride(0),
                         IEEE=y.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
                         BLOCK_K=_pow2(r, 16, 64), **dot_kernel_options(4, 2, y.device.type))
    return y


def lora_decode_fused(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      parts: list[tuple[int, int]], seg_start: torch.Tensor,
                      seg_slot: torch.Tensor) -> torch.Tensor:
    """The LoRA delta of one projection for one-row segments (a decode step) in one launch:
    ``y[row] += (x[row] @ A[p, slot]^T) @ B[slot][:, part p]`` for every part, in place.

    Grid: (row blocks of 16-64 rows, parts, column chunks of each part), about
    ``FUSED_PROGRAMS`` programs; each reduces all of K for its rows (no split-K partials, no
    fp32 workspace; K steps of 8192 / rows, pipelined three deep) and then expands its chunk.
    The programs of one part repeat the same shrink: its A comes from L2 after the first.
    No host sync: graph capturable.

    Args:
        x: [G, K] (rows at ``seg_start``; fp16, bf16 or fp32, unit column stride).
        y: [G, N_total] output view (unit column stride).
        a: [P, S, R, K] (P <= 3), K contiguous; b: [S, R, N_total], N contiguous.
        parts: P ``(column offset, n_p)`` of each part in y.
        seg_start, seg_slot: [G] int32 (each segment one row; slot -1: base row, skipped).
    Returns:
        y.
    Raises:
        ValueError: more than 3 parts.
    """
    if len(parts) > 3:
        raise ValueError(f"lora_decode_fused: at most 3 parts, got {len(parts)}")
    g = seg_start.shape[0]
    if g == 0:
        return y
    if x.stride(1) != 1:
        x = x.contiguous()
    assert y.stride(1) == 1 and b.stride(2) == 1, "lora_decode_fused: column stride must be 1"
    p_num, num_slots, r, k = a.shape
    offs = [off for off, _ in parts] + [0, 0]
    ns = [n for _, n in parts] + [0, 0]
    bm = _pow2(g, 16, 64)
    bn = 64
    # each program walks all of K: wide steps (16 KiB of a rank-16 A a step at bf16 for 16
    # rows), three in flight (the loads feed tl.dot, so Triton pipelines them)
    bk = _pow2(k, 16, (8192 // bm) // (2 if x.dtype == torch.float32 else 1))
    row_blocks = triton.cdiv(g, bm)
    n_max = max(ns)
    chunks = max(1, min(triton.cdiv(FUSED_PROGRAMS, row_blocks * p_num),
                        triton.cdiv(n_max, bn)))
    chunk = triton.cdiv(triton.cdiv(n_max, chunks), bn) * bn
    grid = (row_blocks, p_num, triton.cdiv(n_max, chunk))
    _decode_fused_kernel[grid](
        x, a, b, y, seg_start, seg_slot, g, k, r, num_slots, offs[1], offs[2], ns[0], ns[1],
        ns[2], chunk, x.stride(0), a.stride(0), a.stride(1), a.stride(2), b.stride(0),
        b.stride(1), y.stride(0), IEEE=x.dtype == torch.float32, BLOCK_M=bm,
        BLOCK_R=max(16, triton.next_power_of_2(r)), BLOCK_K=bk, BLOCK_N=bn,
        **dot_kernel_options(4, 3, x.device.type))
    return y


def lora_apply_triton(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      parts: list[tuple[int, int]], seg_start: torch.Tensor,
                      seg_len: torch.Tensor, seg_slot: torch.Tensor, max_len: int,
                      shrink_out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole LoRA delta of one (possibly fused) projection, added to ``y`` in place.

    Args:
        x: [T, K]; y: [T, N_total] (the base output).
        a: [P, S, R, K].
        b: [S, R, N_total] (the parts' columns side by side, as in y).
        parts: P ``(column offset, n_p)`` of each part in y (contiguous, in order).

    Decode steps (``max_len == 1``, at most 3 parts, ``K <= FUSED_MAX_K``) take
    :func:`lora_decode_fused`, one launch, where ``FUSED_DECODE`` is on
    (``FERRY_LORA_FUSED_DECODE=1``; default off).
    """
    if FUSED_DECODE and max_len == 1 and len(parts) <= 3 and x.shape[1] <= FUSED_MAX_K:
        return lora_decode_fused(x, y, a, b, parts, seg_start, seg_slot)
    s = lora_shrink(x, a, seg_start, seg_len, seg_slot, max_len, shrink_out)
    starts = tuple(off for off, _ in parts[1:])
    if expand_tile(starts) is not None and len(parts) <= 3:
        return lora_expand(y, s, b, seg_start, seg_len, seg_slot, max_len, starts)
    r = b.shape[1]
    for p, (off, n) in enumerate(parts):
        lora_expand(y[:, off:off + n], s[:, :, p * r:(p + 1) * r], b[:, :, off:off + n],
                    seg_start, seg_len, seg_slot, max_len)
    return y
