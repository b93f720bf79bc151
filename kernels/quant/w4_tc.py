"""4-bit GEMMs over a K-major layout made at load time (issue 49): a tensor-core kernel for
17 rows and up (prefill too) and a GEMV without ``tl.dot`` for decode rows.

The ``q4k`` layout (:func:`to_kmajor`, from :mod:`kernels.quant.reference`'s ``q4``, so AWQ,
GPTQ with or without act-order, and GGUF Q4_0/Q4_1/Q4_K all reach it):

``qweight`` int32 ``[K / 8, N]``: word ``(r, n)`` holds the codes of weights ``(n, 8r + i)``,
        ``i = 0..7``, in its bits ``4i .. 4i + 3`` (GPTQ's own ``qweight`` order; gemlite's
        "packed over K" layout). A tile of ``BLOCK_K / 8`` words by ``BLOCK_N`` columns is
        contiguous along N: 128-bit coalesced loads, and one word unpacks into 8 consecutive
        K of one column with 8 shifts and masks (no shuffles).
``scales``, ``mins`` ``[K / G, N]`` (their dtype kept: fp32 for AWQ/GPTQ, fp16 or fp32 for
        GGUF): one group's values for a block of columns are one contiguous load.

The weight is ``scale * q + min`` as in ``q4``. The activation permutation of act-order
weights stays the layer's (``wq_perm``), K already being sorted by group.

Kernels (:func:`w4k_linear` picks one by M; :func:`w4k_config` is a small table by M bucket,
no autotuning):

- ``M <= GEMV_MAX_M``: :func:`_w4k_gemv_kernel`, plain 2-D tiles whose every word row
  sits in each thread (``BLOCK_N = 128 num_warps``): one shift serves two nibbles, each
  becomes an fp32 (``1 + q/16`` or ``16 + q/16``) by one LOP3 into the exponent bits (no
  conversion instruction), one FMA per row; the sums over K, the x sums and the group's
  scale and min (once per tile and column) stay in the thread. About 3.6 SASS instructions
  a weight at one row on sm_90 (the row layout's GEMV: 7.1; the first version of this one,
  whose 3-D accumulator Triton laid out unlike its loads: 15.6, docs/benchmarks.md).
- above ``DEQUANT_MIN_M`` rows (64; a config given explicitly runs the kernel at any M):
  :func:`w4k_dequant` writes ``W^T`` in x's dtype, then the vendor GEMM;
- otherwise :func:`_w4k_tc_kernel`: ``y^T = W x^T`` tile by tile with the dequantized
  weights as the MMA's *first* operand (``[BLOCK_N, BLOCK_K]``, the form Hopper's wgmma
  takes from registers) and the activations' transpose as the second, so the rows M are the
  MMA's narrow dimension (16..128) and no tensor-core work is padding at M = 17..64. The
  codes become 16-bit floats without a conversion instruction (the bits ``0x6400 | q`` are
  the fp16 ``1024 + q``, ``0x4300 | q`` the bf16 ``128 + q``), unpacked by ``tl.join`` so a
  word's 8 K stay contiguous in a thread (128-bit stores into the MMA's staging); the
  offset comes off exactly and the group's scale and min apply in x's dtype (``(f - c) s +
  m``, packed HADD2/HFMA2: the dequantize path's precision), so the dot accumulates W x^T
  directly in fp32. fp32 activations (tests, the interpreter) dequantize and multiply in
  IEEE fp32. K is split over more programs when the tiles alone make few
  (:mod:`kernels.split_k`; not on XPU).

Accumulation is fp32 everywhere. The tests run both kernels in the interpreter against
:func:`kernels.quant.reference.wq_matmul_ref` (``tests/kernels/test_w4_tc.py``). The table's
numbers are a design starting point: ``bench/kernels/bench_w4.py`` measures them on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.launch import dot_kernel_options
from kernels.quant.reference import unpack_q4
from kernels.quant.wq_gemv import _store_out
from kernels.split_k import split_k_launch, split_k_trusted

#: the layout name a layer carries once re-laid (``layer.wq_format``)
KMAJOR = "q4k"
#: the most rows of the GEMV kernel (``$FERRY_W4K_GEMV_MAX_M``)
GEMV_MAX_M = int(os.environ.get("FERRY_W4K_GEMV_MAX_M", 4))
#: programs a launch aims for before it splits K (two waves of an H200's 132 SMs)
TARGET_PROGRAMS = 264
#: above this many rows :func:`w4k_linear` dequantizes (:func:`w4k_dequant`) and runs the
#: vendor GEMM (``$FERRY_W4K_DEQUANT_MIN_M``). 64: on the H200 (2026-12-03, c4aa618) the
#: tensor-core kernel took 3.6-5.7x bf16 at M = 128 and 5.8-9.7x at 256, where the dequantize
#: (its cost is the M = 512 time less bf16's: 12-95 us) plus cuBLAS comes to ~1.7-2.4x; at
#: M = 64 the kernel (1.5-2.1x) wins but for qkv (35.3 us against ~33)
DEQUANT_MIN_M = int(os.environ.get("FERRY_W4K_DEQUANT_MIN_M", 64))
#: :func:`w4k_dequant`'s program: weights of K, columns, warps
DEQUANT_BLOCK = (64, 128, 4)


def kmajor_enabled() -> bool:
    """Whether GPU layers re-lay q4 weights into ``q4k`` at load: yes unless
    ``$FERRY_WQ_LAYOUT`` is ``rows`` (:mod:`kernels.quant.wq_triton`'s row-layout path). The
    K-major path is the default since the ``w4-check`` stage measured it ahead of the row
    layout at every M it ran (H200, 2026-12-03: Llama-3-8B bs1 3.16 against 3.95 ms, bs64
    7.69 against 14.84 ms; docs/benchmarks.md)."""
    return os.environ.get("FERRY_WQ_LAYOUT", "kmajor") != "rows"


def to_kmajor(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q4`` -> ``q4k`` (module docstring), on ``qweight``'s device.

    Args:
        qweight: uint8 ``[N, K/2]`` (``q4``); ``scales``, ``mins``: ``[N, K/G]``.
    Returns:
        ``(qweight int32 [K/8, N], scales [K/G, N], mins [K/G, N])``, contiguous, the
        scales' dtype kept.
    """
    q = unpack_q4(qweight).to(torch.int32)                    # [N, K]
    n, k = q.shape
    q = q.view(n, k // 8, 8)
    words = torch.zeros(n, k // 8, dtype=torch.int32, device=q.device)
    for i in range(8):
        words |= q[:, :, i] << (4 * i)                        # wraps into the sign bit at i=7
    return (words.t().contiguous(), scales.t().contiguous(), mins.t().contiguous())


def from_kmajor(qk: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``W [N, K]`` of a ``q4k`` layout in ``dtype`` (computed in fp32):
    the torch reference of the layout."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qk.device)
    q = ((qk.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(-1, qk.shape[1]).float()
    g = q.shape[0] // scales.shape[0]
    w = q * scales.float().repeat_interleave(g, 0) + mins.float().repeat_interleave(g, 0)
    return w.t().contiguous().to(dtype)


@triton.jit
def _w4k_codes(q, MODE: tl.constexpr):
    """Codes ``q`` (int32, 0..15) as floats without a conversion instruction: ``MODE`` 0 fp32
    ``q``; 1 the fp16 ``1024 + q`` (bits ``0x6400 | q``); 2 the bf16 ``128 + q``
    (``0x4300 | q``)."""
    if MODE == 0:
        return q.to(tl.float32)
    elif MODE == 1:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _w4k_unpack(w, MODE: tl.constexpr):
    """Words ``[BN, KW]`` -> codes ``[BN, 8 KW]`` (:func:`_w4k_codes`) by ``tl.join``s, so a
    word's 8 consecutive K stay in one thread, contiguous: the tile then reaches the MMA's
    shared-memory staging as 128-bit stores (a reshape of ``[BN, KW, 8]`` gave one 16-bit
    store a weight on sm_90)."""
    # a join appends the last (fastest) dimension: join nibbles i, i + 4 first, then i, i + 2,
    # then i, i + 1, so that [BN, KW, 2, 2, 2] flattens to K = 8r + i
    q0 = tl.join(tl.join(_w4k_codes(w & 0xF, MODE), _w4k_codes((w >> 16) & 0xF, MODE)),
                 tl.join(_w4k_codes((w >> 8) & 0xF, MODE), _w4k_codes((w >> 24) & 0xF, MODE)))
    q1 = tl.join(tl.join(_w4k_codes((w >> 4) & 0xF, MODE), _w4k_codes((w >> 20) & 0xF, MODE)),
                 tl.join(_w4k_codes((w >> 12) & 0xF, MODE), _w4k_codes((w >> 28) & 0xF, MODE)))
    t = tl.join(q0, q1)
    return tl.reshape(t, (w.shape[0], w.shape[1] * 8))


@triton.jit
def _w4k_tc_kernel(x_ptr, qk_ptr, s_ptr, m_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, G,
                   k_per_split, stride_xm, stride_ym, IEEE: tl.constexpr,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DUP_LOAD: tl.constexpr = False):
    """``y [M, N] = x W^T`` as ``acc^T [BLOCK_N, BLOCK_M] += W_tile @ x_tile^T`` (module
    docstring); ``BLOCK_K`` divides ``G`` (every tile in one group). ``DUP_LOAD``: load the
    words as a ``[BLOCK_N, BLOCK_K]`` tile in which each word is read by its 8 K (gemlite's
    way) instead of ``[BLOCK_N, BLOCK_K/8]`` unpacked by joins (:func:`_w4k_unpack`).
    The tile is dequantized in x's dtype before the dot (``(f - c) s + m``, packed 16-bit
    ops), so the dot accumulates the product itself: on sm_90 ~6.8 SASS instructions a weight
    at 16 rows and ~7.4 at 64 (the first version, codes into the dot and the scale, min and
    per-tile sum of x after it, with the codes staged one 16-bit store at a time: 8.7 and
    13.1)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    KW: tl.constexpr = BLOCK_K // 8
    wi = tl.arange(0, KW)
    kk = tl.arange(0, BLOCK_K)
    ng = K // G
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    MODE: tl.constexpr = 0 if IEEE else (1 if x_ptr.dtype.element_ty == tl.float16 else 2)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        xk = k0 + kk
        if DUP_LOAD:
            w = tl.load(qk_ptr + (xk // 8)[None, :].to(tl.int64) * N + offs_n[:, None],
                        mask=mask_n[:, None] & (xk < K)[None, :], other=0)  # [BN, BK]
            f = _w4k_codes((w >> ((kk % 8) * 4)[None, :]) & 0xF, MODE)
        else:
            kw = k0 // 8 + wi
            mask_kw = kw < K // 8              # only the last K part runs past K
            w = tl.load(qk_ptr + kw[None, :].to(tl.int64) * N + offs_n[:, None],
                        mask=mask_n[:, None] & mask_kw[None, :], other=0)   # [BN, KW]
            f = _w4k_unpack(w, MODE)
        x = tl.load(x_rows + xk[None, :], mask=mask_m[:, None] & (xk < K)[None, :],
                    other=0.0)                                               # [BM, BK]
        g = tl.minimum(k0 // G, ng - 1)
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0)
        mn = tl.load(m_ptr + g * N + offs_n, mask=mask_n, other=0.0)
        if IEEE:
            wt = f * s.to(tl.float32)[:, None] + mn.to(tl.float32)[:, None]
            acc = tl.dot(wt, tl.trans(x), acc, input_precision="ieee")
        else:
            # W in x's dtype: the offset off exactly, then one FMA per weight pair (packed
            # HADD2/HFMA2), the scale and min rounded to x's dtype (the dequantize path's
            # precision); no per-tile sum of x, no epilogue per tile
            xt: tl.constexpr = x_ptr.dtype.element_ty
            wt = (f - (1024.0 if MODE == 1 else 128.0)) * s.to(xt)[:, None] + mn.to(xt)[:, None]
            acc = tl.dot(wt, tl.trans(x), acc)
    _store_out(tl.trans(acc), y_ptr, part_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
               stride_ym, pid_m, pid_n, pid_k, SPLIT_K)


@triton.jit
def _w4k_pair(w, s: tl.constexpr, ZH, ZL):
    """Nibbles ``2p`` and ``2p + 1`` of the int32 words ``w`` after one shift (``s = 15 - 8p``:
    left by ``s``, right by ``-s``), which puts them at bits 15-18 and 19-22: the upper one
    becomes the fp32 ``1 + q/16`` (exponent 0), the lower one ``16 + q/16`` (exponent 4), each
    by one LOP3 ``(v | Z) & mask``. ``ZH`` = ``0x3F800000`` and ``ZL`` = ``0x41800000`` are
    runtime arguments so that ptxas keeps them in two registers: as immediates, one of the
    LOP3's two constants was re-materialized by a move before every LOP3 (0.8 moves a weight
    in the sm_90 SASS). Returns ``(lower, upper)``."""
    if s >= 0:
        v = w << s
    else:
        v = w >> (-s)
    hi = ((v | ZH) & 0x3FF80000).to(tl.float32, bitcast=True)
    lo = ((v | ZL) & 0x41878000).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _w4k_gemv_kernel(x_ptr, qk_ptr, s_ptr, m_ptr, y_ptr, part_ptr, lock_ptr, M, N, K,
                     k_per_split, stride_xm, stride_ym, ZH, ZL, GROUP: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, X_BF16: tl.constexpr):
    """A few rows (decode), no ``tl.dot``: a ``[BLOCK_K/8, BLOCK_N]`` tile of words, read with
    128-bit loads along N. With ``BLOCK_N = 128 num_warps`` each thread holds 4 columns of
    *every* word row of the tile, so the sums over K stay in the thread (no shuffles, no
    shared memory) and a group's scale and min, loaded as ``[BLOCK_N]``, land in the
    columns' own layout. Per pair of nibbles a shift, two LOP3s (:func:`_w4k_pair`) and two
    FMAs against the x values ``8r + 2p`` (``16 + q/16``) and ``8r + 2p + 1`` (``1 + q/16``),
    so per tile ``t = 16 X_lo + X_hi + (sum x q)/16`` and ``y += 16 s (t - X_hi - 16 X_lo) + m
    (X_lo + X_hi)``. ``X_BF16``: x read as int32 pairs (one load for both x values of a pair,
    their fp32 by a shift and an and). ``BLOCK_K`` divides ``GROUP``; K a multiple of
    ``BLOCK_K``; rows past M read row M - 1 (their output is masked)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    KW: tl.constexpr = BLOCK_K // 8
    wi = tl.arange(0, KW)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = qk_ptr + (k_start // 8 + wi)[:, None].to(tl.int64) * N + offs_n[None, :]
    x_off = k_start + 8 * wi                   # each word row's first x column
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w = tl.load(w_ptrs, mask=mask_n[None, :])     # masked columns: garbage, not stored
        g = k0 // GROUP
        s16 = 16.0 * tl.load(s_ptr + g * N + offs_n, mask=mask_n).to(tl.float32)
        mn = tl.load(m_ptr + g * N + offs_n, mask=mask_n).to(tl.float32)
        for r in tl.static_range(BLOCK_M):
            row = tl.minimum(pid_m * BLOCK_M + r, M - 1).to(tl.int64)
            t = tl.zeros((KW, BLOCK_N), dtype=tl.float32)
            x_lo = tl.zeros((KW,), dtype=tl.float32)
            x_hi = tl.zeros((KW,), dtype=tl.float32)
            for p in tl.static_range(4):
                lo, hi = _w4k_pair(w, 15 - 8 * p, ZH, ZL)
                if X_BF16:
                    xp = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + row * (stride_xm // 2)
                                 + x_off // 2 + p)
                    xl = (xp << 16).to(tl.float32, bitcast=True)
                    xh = (xp & -65536).to(tl.float32, bitcast=True)
                else:
                    xr = x_ptr + row * stride_xm + x_off + 2 * p
                    xl = tl.load(xr).to(tl.float32)
                    xh = tl.load(xr + 1).to(tl.float32)
                t += xl[:, None] * lo
                t += xh[:, None] * hi
                x_lo += xl
                x_hi += xh
            a_lo = tl.sum(x_lo, axis=0)
            a_hi = tl.sum(x_hi, axis=0)
            part = s16 * (tl.sum(t, axis=0) - a_hi - 16.0 * a_lo) + mn * (a_lo + a_hi)
            if BLOCK_M == 1:
                acc += part[None, :]
            else:
                acc += tl.where(rows[:, None] == r, part[None, :], 0.0)
        w_ptrs += KW * N
        x_off += BLOCK_K
    _store_out(acc, y_ptr, part_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
               stride_ym, pid_m, pid_n, pid_k, SPLIT_K)


@triton.jit
def _w4k_dequant_kernel(qk_ptr, s_ptr, m_ptr, wt_ptr, N, K, G, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """``W^T [K, N]`` in the output's dtype from ``q4k``: loads and stores both contiguous
    along N; ``BLOCK_K`` divides ``G``."""
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    KW: tl.constexpr = BLOCK_K // 8
    kw = k0 // 8 + tl.arange(0, KW)
    mask = (kw < K // 8)[:, None] & mask_n[None, :]
    w = tl.load(qk_ptr + kw[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0)
    q = tl.reshape((w[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF,
                   (BLOCK_K, BLOCK_N))
    g = k0 // G
    s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    mn = tl.load(m_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out = q.to(tl.float32) * s[None, :] + mn[None, :]
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(wt_ptr + kk[:, None].to(tl.int64) * N + offs_n[None, :],
             out.to(wt_ptr.dtype.element_ty), mask=(kk < K)[:, None] & mask_n[None, :])


def w4k_dequant(qk: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                dtype: torch.dtype, block: tuple[int, int, int] = DEQUANT_BLOCK
                ) -> torch.Tensor:
    """``W^T [K, N]`` in ``dtype`` (``s * q + min`` in fp32, rounded once) from ``q4k``;
    ``block``: weights of K (a divisor of the group, at most), columns and warps per program."""
    k, n = qk.shape[0] * 8, qk.shape[1]
    group = k // scales.shape[0]
    block_k = min(block[0], group)
    wt = torch.empty(k, n, dtype=dtype, device=qk.device)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block[1]))
    _w4k_dequant_kernel[grid](qk, scales, mins, wt, n, k, group, BLOCK_K=block_k,
                              BLOCK_N=block[1], num_warps=block[2])
    return wt


#: by the largest M of a bucket: (BLOCK_M, BLOCK_N, most K parts, warps, stages, programs
#: aimed at); the GEMV bucket's BLOCK_M is M's next power of two. The GEMV: 256 columns on 2
#: warps (the kernel's layout wants ``BLOCK_N = 128 num_warps``), up to ~1024 programs of
#: 1-7 tiles (at ~80 registers about 12 fit an SM: one wave on 132 SMs). 16 and 32 rows: ~512
#: programs (the old row path's 512 beat the first table's 320 at M = 16 for o and down,
#: 2026-12-03), at most one wave of the 40 KB tiles.
W4K_TABLE = ((GEMV_MAX_M, (None, 256, 64, 2, 1, 1024)),
             (16, (16, 64, 8, 4, 4, 512)),
             (32, (32, 64, 8, 4, 4, 512)),
             (64, (64, 64, 4, 4, 3, 288)),
             (128, (64, 128, 2, 8, 3, 288)),
             (None, (128, 128, 1, 8, 3, 288)))


def _block_k(group: int, m: int) -> int:
    """The GEMV (``m <= GEMV_MAX_M``): 64 weights of K, or 32 for groups of 32; the
    tensor-core kernel: the largest of 128, 64, 32 that divides the group (64 at most above
    128 rows: the prefill tile's shared memory)."""
    for bk in ((64, 32) if m <= GEMV_MAX_M else (128, 64, 32)):
        if group % bk == 0 and (m <= 128 or bk <= 64):
            return bk
    raise ValueError(f"group size {group} is not a multiple of 32")


def w4k_config(m: int, n: int, k: int, group: int, device_type: str = "cuda") -> dict:
    """Launch parameters of :func:`w4k_linear` at ``m`` rows: the bucket's row of
    :data:`W4K_TABLE`; K split into up to the bucket's parts, ``programs // tiles`` of them
    (never on XPU); the GEMV's parts are then evened out (``ceil(k_tiles / tiles per
    part)``, none empty). ``GEMV`` True below ``GEMV_MAX_M + 1`` rows.

    Raises:
        ValueError: a group size that is not a multiple of 32.
    """
    row = next(r for top, r in W4K_TABLE if top is None or m <= top)
    block_m, block_n, max_split, warps, stages, programs = row
    gemv = block_m is None
    if gemv:
        block_m = triton.next_power_of_2(m)
    block_k = _block_k(group, m)
    k_tiles = triton.cdiv(k, block_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    if split_k_trusted(device_type):
        split = max(1, min(max_split, programs // tiles, k_tiles))
        if gemv:
            split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))
    # the GEMV has no tl.dot: its warps are 32-lane sub-groups on XPU too (kernels/launch.py)
    opts = (dict(num_warps=warps, num_stages=stages) if gemv
            else dot_kernel_options(warps, stages, device_type))
    return dict(GEMV=gemv, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                **opts)


def w4k_linear(x: torch.Tensor, qk: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T`` -> ``[M, N]`` in x's dtype, W in the ``q4k`` layout.

    Args:
        x: [M, K] fp16/bf16/fp32 (fp32: IEEE products), M >= 1.
        qk: int32 ``[K/8, N]``; scales, mins: ``[K/G, N]`` fp16/bf16/fp32, G a multiple of 32.
        config: :func:`w4k_config`'s keys instead of the table (benchmarks, tests); its
            ``BLOCK_K`` must divide G. Without one, above ``DEQUANT_MIN_M`` rows the weight
            is dequantized (:func:`w4k_dequant`) and multiplied by the vendor GEMM.
    Raises:
        ValueError: a ``BLOCK_K`` that does not divide the group, or a split-K launch with
            more than 65536 output blocks.
    """
    m, k = x.shape
    n = qk.shape[1]
    group = k // scales.shape[0]
    if config is None and m > DEQUANT_MIN_M:
        return torch.matmul(x, w4k_dequant(qk, scales, mins, x.dtype))
    cfg = dict(config or w4k_config(m, n, k, group, x.device.type))
    if group % cfg["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {cfg['BLOCK_K']} does not divide the group size {group}")
    if x.stride(1) != 1:
        x = x.contiguous()
    split = cfg.pop("SPLIT_K", 1)
    gemv = cfg.pop("GEMV", False)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    m_blocks = triton.cdiv(m, cfg["BLOCK_M"])
    n_blocks, k_per_split, part, locks = split_k_launch(y, k, split, cfg["BLOCK_N"],
                                                        cfg["BLOCK_K"], m_blocks)
    grid = (m_blocks, n_blocks, split)
    head = (x, qk, scales, mins, y, part, locks, m, n, k)
    tail = (k_per_split, x.stride(0), y.stride(0))
    if gemv:
        cfg.pop("DUP_LOAD", None)
        # bf16 x read as int32 pairs: needs 4-byte aligned rows
        pairs = (x.dtype == torch.bfloat16 and x.stride(0) % 2 == 0
                 and x.data_ptr() % 4 == 0)
        _w4k_gemv_kernel[grid](*head, *tail, 0x3F800000, 0x41800000, GROUP=group,
                               SPLIT_K=split, X_BF16=pairs, **cfg)
    else:
        _w4k_tc_kernel[grid](*head, group, *tail, IEEE=x.dtype == torch.float32,
                             SPLIT_K=split, **cfg)
    return y
