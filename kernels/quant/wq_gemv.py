"""The q4 GEMV kernels of :func:`kernels.quant.wq_triton.wq_linear` (decode rows: M <= 4)
and the split-K epilogue they share with its tiled kernel.

No ``tl.dot``: the weights (``qweight [N, K/2]`` uint8 viewed as int32 words ``[N, K/8]``)
become floats by bit operations alone. Word ``w`` of a 32-weight chunk ``c`` holds bytes
``4w .. 4w + 3``, so its nibble ``i`` (bits ``4i .. 4i + 3``) is weight ``32c + 16 (i % 2) +
4w + i // 2`` (:func:`kernels.quant.reference.pack_q4`'s byte order). Shifting the nibble to
bits 19-22 and or-ing ``0x3F800000`` gives the fp32 ``1 + q / 16`` (an exponent of 0, q the
top mantissa bits): a weight costs a shift, an and, an or and an FMA, with no conversion
instruction. Per tile ``t = sum x (1 + q/16)``, so ``sum x q = 16 (t - sum x)``; a group's
scale and min apply once per tile when the tile lies in one group, else once per word
(GGUF's 32-weight blocks): ``y = sum_g s_g (x . q)_g + m_g (sum x)_g``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_out(acc, y_ptr, part_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
               stride_ym, pid_m, pid_n, pid_k, SPLIT_K: tl.constexpr):
    """Write the fp32 tile ``acc [BLOCK_M, BLOCK_N]``: directly, or (split K) as this K
    part's partial, the last part of the block of rows and columns to arrive summing the
    partials in K order (``kernels/split_k.py``)."""
    out_mask = mask_m[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        mn_idx = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + mn_idx, acc, mask=out_mask)
        tl.debug_barrier()
        # one counter per (block of rows, block of columns): the blocks of rows of one
        # column block run concurrently on a GPU (the interpreter runs them in turn)
        lock = lock_ptr + pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for sk in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + sk * M * N + mn_idx, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


@triton.jit
def _nibble_f32(w, i: tl.constexpr):
    """Nibble ``i`` (bits ``4i .. 4i + 3``) of the int32 words ``w`` as the fp32 ``1 + q / 16``:
    the nibble moved to mantissa bits 19-22 under the exponent of 1.0."""
    if 4 * i <= 19:
        v = (w << (19 - 4 * i)) & 0x780000
    else:
        v = (w >> (4 * i - 19)) & 0x780000
    return (v | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _wq_gemv_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, G,
                    k_per_split, stride_xm, stride_ym, ONE_GROUP: tl.constexpr,
                    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """q4 for a few rows (decode): no ``tl.dot``; the weights are read as int32 words and
    each nibble becomes the fp32 ``1 + q / 16`` by bit operations alone (``(q << 19) |
    0x3F800000``: no conversion instruction), so a weight costs a shift, an and-or and an
    FMA. Word ``w`` of a 32-weight chunk ``c`` holds bytes ``4w .. 4w + 3``: its nibble
    ``i`` is weight ``32c + 16 (i % 2) + 4w + i // 2``. Per tile: ``t = sum x (1 + q/16)``,
    so ``sum x q = 16 (t - sum x)``; the group's scale and min apply once per tile (tiles
    in one group) or once per word (GGUF's 32-weight blocks)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    ng = K // G
    KW: tl.constexpr = BLOCK_K // 8
    wi = tl.arange(0, KW)
    kbase = (wi // 4) * 32 + (wi % 4) * 4      # weight index of each word's nibble 0
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = qw_ptr + offs_n[:, None].to(tl.int64) * (K // 8)
    s_rows = s_ptr + offs_n.to(tl.int64) * ng
    m_rows = m_ptr + offs_n.to(tl.int64) * ng
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, KW), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        kw = k0 // 8 + wi
        mask_k = kw < K // 8                   # K is a multiple of 32: whole chunks
        w = tl.load(w_rows + kw[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0)
        xmask = mask_m[:, None] & mask_k[None, :]
        t = tl.zeros((BLOCK_M, BLOCK_N, KW), dtype=tl.float32)
        xs = tl.zeros((BLOCK_M, KW), dtype=tl.float32)
        for i in tl.static_range(8):
            qf = _nibble_f32(w, i)
            xv = tl.load(x_rows + (k0 + kbase + 16 * (i % 2) + i // 2)[None, :], mask=xmask,
                         other=0.0).to(tl.float32)
            t += xv[:, None, :] * qf[None, :, :]
            xs += xv
        if ONE_GROUP:
            g = tl.minimum(k0 // G, ng - 1)    # the last K part may run past K (x is 0)
            s = tl.load(s_rows + g, mask=mask_n, other=0.0).to(tl.float32)
            mn = tl.load(m_rows + g, mask=mask_n, other=0.0).to(tl.float32)
            xsum = tl.sum(xs, axis=1)
            acc += (16.0 * (tl.sum(t, axis=2) - xsum[:, None]) * s[None, :]
                    + xsum[:, None] * mn[None, :])
        else:
            gw = tl.minimum((k0 + (wi // 4) * 32) // G, ng - 1)
            wmask = mask_n[:, None] & mask_k[None, :]
            s = tl.load(s_rows[:, None] + gw[None, :], mask=wmask, other=0.0).to(tl.float32)
            mn = tl.load(m_rows[:, None] + gw[None, :], mask=wmask, other=0.0).to(tl.float32)
            acc3 += (16.0 * (t - xs[:, None, :]) * s[None, :, :]
                     + xs[:, None, :] * mn[None, :, :])
    if not ONE_GROUP:
        acc = tl.sum(acc3, axis=2)
    _store_out(acc, y_ptr, part_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
               stride_ym, pid_m, pid_n, pid_k, SPLIT_K)


@triton.jit
def _wq_gemv1_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, part_ptr, lock_ptr, N, K, G,
                     k_per_split, ONE_GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`_wq_gemv_kernel` for one row (bs1 decode) in two dimensions: a thread holding
    several weight rows of the same words loads each x value once for all of them."""
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ng = K // G
    KW: tl.constexpr = BLOCK_K // 8
    wi = tl.arange(0, KW)
    kbase = (wi // 4) * 32 + (wi % 4) * 4
    w_rows = qw_ptr + offs_n[:, None].to(tl.int64) * (K // 8)
    s_rows = s_ptr + offs_n.to(tl.int64) * ng
    m_rows = m_ptr + offs_n.to(tl.int64) * ng
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        kw = k0 // 8 + wi
        mask_k = kw < K // 8
        w = tl.load(w_rows + kw[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0)
        t = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
        xs = tl.zeros((KW,), dtype=tl.float32)
        for i in tl.static_range(8):
            qf = _nibble_f32(w, i)
            xv = tl.load(x_ptr + k0 + kbase + 16 * (i % 2) + i // 2, mask=mask_k,
                         other=0.0).to(tl.float32)
            t += xv[None, :] * qf
            xs += xv
        if ONE_GROUP:
            g = tl.minimum(k0 // G, ng - 1)
            s = tl.load(s_rows + g, mask=mask_n, other=0.0).to(tl.float32)
            mn = tl.load(m_rows + g, mask=mask_n, other=0.0).to(tl.float32)
            xsum = tl.sum(xs, axis=0)
            acc += 16.0 * (tl.sum(t, axis=1) - xsum) * s + xsum * mn
        else:
            gw = tl.minimum((k0 + (wi // 4) * 32) // G, ng - 1)
            wmask = mask_n[:, None] & mask_k[None, :]
            s = tl.load(s_rows[:, None] + gw[None, :], mask=wmask, other=0.0).to(tl.float32)
            mn = tl.load(m_rows[:, None] + gw[None, :], mask=wmask, other=0.0).to(tl.float32)
            acc2 += 16.0 * (t - xs[None, :]) * s + xs[None, :] * mn
    if not ONE_GROUP:
        acc = tl.sum(acc2, axis=1)
    offs_m = tl.arange(0, 1)
    _store_out(acc[None, :], y_ptr, part_ptr, lock_ptr, offs_m, offs_n, offs_m < 1, mask_n,
               1, N, N, 0, pid_n, pid_k, SPLIT_K)
