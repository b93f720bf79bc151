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

- ``M <= GEMV_MAX_M``: :func:`_w4k_gemv_kernel`: each nibble becomes the fp32 ``1 + q / 16``
  by a shift and an and-or (no conversion instruction, as :mod:`kernels.quant.wq_gemv`);
  a weight costs a shift, a lop3 and one FMA per row; the group's scale and min are loaded
  once per tile (``BLOCK_K`` divides ``G``) and applied once per word and column (two FMAs:
  ``sum x (s q + m) = t (16 s) + (sum x) (m - 16 s)`` with ``t = sum x (1 + q/16)``), and
  the word rows, spread over warps, are reduced once at the end, not per tile.
- above ``DEQUANT_MIN_M`` rows (prefill; a config given explicitly runs the kernel at any
  M): :func:`w4k_dequant` writes ``W^T`` in x's dtype, then the vendor GEMM;
- otherwise :func:`_w4k_tc_kernel`: ``y^T = W x^T`` tile by tile with the dequantized
  weights as the MMA's *first* operand (``[BLOCK_N, BLOCK_K]`` in registers, the form
  Hopper's wgmma takes from registers) and the activations' transpose as the second, so the
  rows M are the MMA's narrow dimension (16..128) and no tensor-core work is padding at
  M = 17..64. The codes become 16-bit floats without a conversion instruction (the bits
  ``0x6400 | q`` are the fp16 ``1024 + q``, ``0x4300 | q`` the bf16 ``128 + q``); the offset
  times ``sum x`` comes off after the dot and the group's scale and min apply once per tile
  in fp32: ``acc += (d - c sum x) s + m sum x``. fp32 activations (tests, the interpreter)
  multiply the codes in IEEE fp32. K is split over more programs when the tiles alone make
  few (:mod:`kernels.split_k`; not on XPU).

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
#: vendor GEMM (``$FERRY_W4K_DEQUANT_MIN_M``; the tensor-core kernel's prefill tiles
#: against cuBLAS are measured by the ``w4`` stage, ``new_tc_us`` in its JSON)
DEQUANT_MIN_M = int(os.environ.get("FERRY_W4K_DEQUANT_MIN_M", 256))
#: :func:`w4k_dequant`'s program: weights of K, columns, warps
DEQUANT_BLOCK = (64, 128, 4)


def kmajor_enabled() -> bool:
    """Whether GPU layers re-lay q4 weights into ``q4k`` at load: ``$FERRY_WQ_LAYOUT`` is
    ``kmajor`` (``rows``, the default, keeps :mod:`kernels.quant.wq_triton`'s path until the
    ``w4`` stage of ``bench/h200_run.sh`` has measured both)."""
    return os.environ.get("FERRY_WQ_LAYOUT", "rows") == "kmajor"


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
def _w4k_tc_kernel(x_ptr, qk_ptr, s_ptr, m_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, G,
                   k_per_split, stride_xm, stride_ym, IEEE: tl.constexpr,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DUP_LOAD: tl.constexpr = False):
    """``y [M, N] = x W^T`` as ``acc^T [BLOCK_N, BLOCK_M] += W_tile @ x_tile^T`` (module
    docstring); ``BLOCK_K`` divides ``G`` (every tile in one group). ``DUP_LOAD``: load the
    words as a ``[BLOCK_N, BLOCK_K]`` tile in which each word is read by its 8 K (gemlite's
    way, no reshape) instead of ``[BLOCK_N, BLOCK_K/8]`` unpacked by a reshape; which one
    Triton compiles better is for the ``w4-sweep`` stage to say."""
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
    shifts = tl.arange(0, 8) * 4
    ng = K // G
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        xk = k0 + kk
        if DUP_LOAD:
            w = tl.load(qk_ptr + (xk // 8)[None, :].to(tl.int64) * N + offs_n[:, None],
                        mask=mask_n[:, None] & (xk < K)[None, :], other=0)  # [BN, BK]
            q = (w >> ((kk % 8) * 4)[None, :]) & 0xF
        else:
            kw = k0 // 8 + wi
            mask_kw = kw < K // 8              # only the last K part runs past K
            w = tl.load(qk_ptr + kw[None, :].to(tl.int64) * N + offs_n[:, None],
                        mask=mask_n[:, None] & mask_kw[None, :], other=0)   # [BN, KW]
            q = tl.reshape((w[:, :, None] >> shifts[None, None, :]) & 0xF,
                           (BLOCK_N, BLOCK_K))
        x = tl.load(x_rows + xk[None, :], mask=mask_m[:, None] & (xk < K)[None, :],
                    other=0.0)                                               # [BM, BK]
        g = tl.minimum(k0 // G, ng - 1)
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        xsum = tl.sum(x.to(tl.float32), axis=1)
        if IEEE:
            d = tl.dot(q.to(tl.float32), tl.trans(x), input_precision="ieee")
            bias = 0.0
        elif x.dtype == tl.float16:
            f = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)     # 1024 + q
            d = tl.dot(f, tl.trans(x))
            bias = 1024.0
        else:
            f = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)    # 128 + q
            d = tl.dot(f, tl.trans(x))
            bias = 128.0
        acc += (d - bias * xsum[None, :]) * s[:, None] + xsum[None, :] * mn[:, None]
    _store_out(tl.trans(acc), y_ptr, part_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
               stride_ym, pid_m, pid_n, pid_k, SPLIT_K)


@triton.jit
def _w4k_nibble_f32(w, i: tl.constexpr):
    """Nibble ``i`` of the int32 words ``w`` as the fp32 ``1 + q / 16``."""
    if 4 * i <= 19:
        v = (w << (19 - 4 * i)) & 0x780000
    else:
        v = (w >> (4 * i - 19)) & 0x780000
    return (v | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _w4k_gemv_kernel(x_ptr, qk_ptr, s_ptr, m_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, G,
                     k_per_split, stride_xm, stride_ym, SPLIT_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A few rows (decode), no ``tl.dot``: words ``[BLOCK_K/8, BLOCK_N]`` (coalesced along
    N), nibble ``i`` of word ``r`` against x column ``8r + i``; ``BLOCK_K`` divides ``G``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    KW: tl.constexpr = BLOCK_K // 8
    wi = tl.arange(0, KW)
    ng = K // G
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    # per (row, word row, column) partial sums, reduced over the word rows once at the end
    # (the word rows of a tile are spread over warps: a reduction per tile would cross them)
    acc3 = tl.zeros((BLOCK_M, KW, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        kw = k0 // 8 + wi
        mask_kw = kw < K // 8
        w = tl.load(qk_ptr + kw[:, None].to(tl.int64) * N + offs_n[None, :],
                    mask=mask_kw[:, None] & mask_n[None, :], other=0)       # [KW, BN]
        g = tl.minimum(k0 // G, ng - 1)
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        xmask = mask_m[:, None] & mask_kw[None, :]
        t = tl.zeros((BLOCK_M, KW, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((BLOCK_M, KW), dtype=tl.float32)
        for i in tl.static_range(8):
            qf = _w4k_nibble_f32(w, i)
            xv = tl.load(x_rows + (k0 + 8 * wi + i)[None, :], mask=xmask,
                         other=0.0).to(tl.float32)                          # [BM, KW]
            t += xv[:, :, None] * qf[None, :, :]
            xs += xv
        # sum x (s q + m) = 16 s (t - sum x) + m sum x = t (16 s) + (sum x) (m - 16 s):
        # two FMAs per word and column, 1/4 of an instruction per weight and row
        s16 = 16.0 * s
        acc3 += t * s16[None, None, :] + xs[:, :, None] * (mn - s16)[None, None, :]
    acc = tl.sum(acc3, axis=1)
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


#: by the largest M of a bucket: (BLOCK_M, BLOCK_N, most K parts, warps, stages); the
#: GEMV bucket's BLOCK_M is M's next power of two
W4K_TABLE = ((GEMV_MAX_M, (None, 128, 8, 4, 2)),
             (16, (16, 64, 8, 4, 4)),
             (32, (32, 64, 8, 4, 4)),
             (64, (64, 64, 4, 4, 3)),
             (128, (64, 128, 2, 8, 3)),
             (None, (128, 128, 1, 8, 3)))


def _block_k(group: int, m: int) -> int:
    """The largest of 128, 64, 32 that divides the group (64 at most above 128 rows: the
    prefill tile's shared memory)."""
    for bk in (128, 64, 32):
        if group % bk == 0 and (m <= 128 or bk <= 64):
            return bk
    raise ValueError(f"group size {group} is not a multiple of 32")


def w4k_config(m: int, n: int, k: int, group: int, device_type: str = "cuda") -> dict:
    """Launch parameters of :func:`w4k_linear` at ``m`` rows: the bucket's row of
    :data:`W4K_TABLE`; K split into up to the bucket's parts so that about
    ``TARGET_PROGRAMS`` run (never on XPU). ``GEMV`` True below ``GEMV_MAX_M + 1`` rows.

    Raises:
        ValueError: a group size that is not a multiple of 32.
    """
    row = next(r for top, r in W4K_TABLE if top is None or m <= top)
    block_m, block_n, max_split, warps, stages = row
    gemv = block_m is None
    if gemv:   # 3 and 4 rows: 8 warps (two [rows, K/8, N] fp32 tiles in registers)
        block_m = triton.next_power_of_2(m)
        warps = warps if block_m <= 2 else 8
    block_k = _block_k(group, m)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    if split_k_trusted(device_type):
        split = max(1, min(max_split, triton.cdiv(TARGET_PROGRAMS, tiles),
                           triton.cdiv(k, block_k)))
    return dict(GEMV=gemv, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                **dot_kernel_options(warps, stages, device_type))


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
    args = (x, qk, scales, mins, y, part, locks, m, n, k, group, k_per_split, x.stride(0),
            y.stride(0))
    if gemv:
        cfg.pop("DUP_LOAD", None)
        _w4k_gemv_kernel[grid](*args, SPLIT_K=split, **cfg)
    else:
        _w4k_tc_kernel[grid](*args, IEEE=x.dtype == torch.float32, SPLIT_K=split, **cfg)
    return y
