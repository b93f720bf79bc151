"""Triton GEMMs over weight-only low-bit layouts (:mod:`kernels.quant.reference`'s q4 and q8).

``wq_linear(x [M, K], fmt, qweight, scales, mins) -> [M, N]`` in x's dtype (W4A16 / W8A16
with fp16 or bf16 activations; fp32 activations multiply in IEEE fp32). One code path for
CUDA and XPU, by the number of rows M:

- q4, ``M <= GEMV_MAX_M`` (4, bs1-4 decode): the GEMV kernels of :mod:`kernels.quant.wq_gemv`
  (no ``tl.dot``; nibbles to floats by bit operations), K split in up to 8 parts;
- ``M <= SMALL_M_MAX`` (16, decode): a ``BLOCK_M = 16`` tile of x against ``BLOCK_N``
  weight rows, K split into up to 8 parts so that about 2048 programs stream the weights
  (the FP8 small-M kernel's scheme, ``kernels/split_k.py``: the last part of a block of
  columns to arrive sums the fp32 partials in K order; no split on XPU);
- ``M <= DEQUANT_MIN_M`` (256, or ``$FERRY_WQ_DEQUANT_MIN_M``): the same kernel with larger ``BLOCK_M`` tiles, split over K
  when the tiles alone make few programs (:func:`wq_config`);
- larger M (prefill): :func:`wq_dequant` writes W in x's dtype (one pass over the packed
  weights) and ``torch.matmul`` multiplies (vendor GEMM; the dequantized copy is W's size
  in 16 bits, freed after the call). At M = 2048 with K = 4096 the GEMM is ~25x the
  dequantization's time.

The q4 tile: a ``BLOCK_K``-weight slice of a row is ``BLOCK_K / 2`` bytes, loaded once;
byte ``b`` of a 32-weight chunk ``c`` holds weight ``32c + b`` in its low nibble and
``32c + 16 + b`` in its high nibble, so the tile is two ``tl.dot``s: the low nibbles against
the x columns ``32c + b`` and the high ones against ``32c + 16 + b``. When the tile lies in
one quantization group (``G % BLOCK_K == 0``: AWQ/GPTQ groups of 128 or more) the integer
codes (as 16-bit floats ``1024 + q`` / ``128 + q`` made by or-ing the exponent bits, the
offset taken off after the dot) are multiplied and each product is scaled in fp32 afterwards:
``sum_k x q s + m x`` = ``s (x . q) + m (sum x)``; otherwise (GGUF's 32-weight blocks) the
codes are dequantized in registers (``s q + m`` in fp32, cast to x's dtype) before the dot.
Accumulation is fp32 throughout. The tests run every path in the interpreter against
:func:`kernels.quant.reference.wq_matmul_ref`. The tile sizes are a heuristic, not tuned.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.launch import dot_kernel_options
from kernels.quant.wq_gemv import _store_out, _wq_gemv1_kernel, _wq_gemv_kernel
from kernels.split_k import split_k_launch, split_k_locks, split_k_trusted  # noqa: F401

#: the most rows of the split-K (decode) configuration
SMALL_M_MAX = 16
#: the most rows of the q4 GEMV kernel (no ``tl.dot``; ``$FERRY_WQ_GEMV_MAX_M``)
GEMV_MAX_M = int(os.environ.get("FERRY_WQ_GEMV_MAX_M", 4))
#: above this many rows: dequantize, then the vendor GEMM (``FERRY_WQ_DEQUANT_MIN_M`` changes
#: it: the kernel's tiles against cuBLAS at prefill sizes are not measured yet)
DEQUANT_MIN_M = int(os.environ.get("FERRY_WQ_DEQUANT_MIN_M", 256))
#: :func:`wq_dequant`'s program: rows, weights of K, warps
DEQUANT_BLOCK = (16, 256, 4)  # the H200 sweep's best of five (2.8-3.2 TB/s)


@triton.jit
def _wq_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, G,
               k_per_split, stride_xm, stride_ym,
               Q4: tl.constexpr, ONE_GROUP: tl.constexpr, IEEE: tl.constexpr,
               SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    ng = K // G
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    s_rows = s_ptr + offs_n.to(tl.int64) * ng
    m_rows = m_ptr + offs_n.to(tl.int64) * ng
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    if Q4:
        b = tl.arange(0, BLOCK_K // 2)
        lo = (b // 16) * 32 + b % 16          # weight index of byte b's low nibble
        w_rows = qw_ptr + offs_n[:, None].to(tl.int64) * (K // 2)
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            k_lo = k0 + lo
            mask_k = k_lo < K                  # K is a multiple of 32: hi is in range too
            x_lo = tl.load(x_rows + k_lo[None, :], mask=mask_m[:, None] & mask_k[None, :],
                           other=0.0)
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :],
                           mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            wb = tl.load(w_rows + (k0 // 2 + b)[None, :], mask=mask_n[:, None] & mask_k[None, :],
                         other=0).to(tl.int32)
            q_lo = wb & 0xF
            q_hi = wb >> 4
            if ONE_GROUP:
                g = tl.minimum(k0 // G, ng - 1)  # the last K part may run past K (x is 0)
                s = tl.load(s_rows + g, mask=mask_n, other=0.0).to(tl.float32)
                mn = tl.load(m_rows + g, mask=mask_n, other=0.0).to(tl.float32)
                if IEEE:
                    d = tl.dot(x_lo, tl.trans(q_lo.to(tl.float32)), input_precision="ieee")
                    d += tl.dot(x_hi, tl.trans(q_hi.to(tl.float32)), input_precision="ieee")
                    bias = 0.0
                else:
                    # codes as 16-bit floats without a conversion instruction: the bits
                    # 0x6400 | q are the fp16 1024 + q, 0x4300 | q the bf16 128 + q; the
                    # bias times sum(x) comes off after the dot (fp32, exact products)
                    if x_lo.dtype == tl.float16:
                        f_lo = (q_lo | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
                        f_hi = (q_hi | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
                        bias = 1024.0
                    else:
                        f_lo = (q_lo | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
                        f_hi = (q_hi | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
                        bias = 128.0
                    d = tl.dot(x_lo, tl.trans(f_lo))
                    d += tl.dot(x_hi, tl.trans(f_hi))
                xsum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
                acc += (d - bias * xsum[:, None]) * s[None, :] + xsum[:, None] * mn[None, :]
            else:
                sidx = (k_lo // G)[None, :]
                wmask = mask_n[:, None] & mask_k[None, :]
                s = tl.load(s_rows[:, None] + sidx, mask=wmask, other=0.0).to(tl.float32)
                mn = tl.load(m_rows[:, None] + sidx, mask=wmask, other=0.0).to(tl.float32)
                w_lo = q_lo.to(tl.float32) * s + mn
                w_hi = q_hi.to(tl.float32) * s + mn
                if IEEE:
                    acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
                    acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
                else:
                    acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)))
                    acc += tl.dot(x_hi, tl.trans(w_hi.to(x_lo.dtype)))
    else:
        kk0 = tl.arange(0, BLOCK_K)
        w_rows = qw_ptr + offs_n[:, None].to(tl.int64) * K
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            kk = k0 + kk0
            mask_k = kk < K
            x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            wmask = mask_n[:, None] & mask_k[None, :]
            q = tl.load(w_rows + kk[None, :], mask=wmask, other=0).to(tl.float32)
            w = q * tl.load(s_rows[:, None] + (kk // G)[None, :], mask=wmask,
                            other=0.0).to(tl.float32)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    _store_out(acc, y_ptr, part_ptr, lock_ptr, offs_m, offs_n, mask_m, mask_n, M, N,
               stride_ym, pid_m, pid_n, pid_k, SPLIT_K)


@triton.jit
def _wq_dequant_kernel(qw_ptr, s_ptr, m_ptr, w_ptr, N, K, G, Q4: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ng = K // G
    out_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * ng
    if Q4:
        # [rows, 32-weight chunks, 16 bytes]: one scale and min per chunk (G is a multiple
        # of 32), each chunk's low nibbles are its weights 0-15, the high ones 16-31
        NC: tl.constexpr = BLOCK_K // 32
        c = tl.program_id(1) * NC + tl.arange(0, NC)
        j = tl.arange(0, 16)
        mask = mask_n[:, None, None] & (c < K // 32)[None, :, None]
        rows3 = offs_n[:, None, None].to(tl.int64)
        wb = tl.load(qw_ptr + rows3 * (K // 2) + (c * 16)[None, :, None] + j[None, None, :],
                     mask=mask, other=0).to(tl.int32)
        sidx = rows3 * ng + ((c * 32) // G)[None, :, None]
        s = tl.load(s_ptr + sidx, mask=mask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + sidx, mask=mask, other=0.0).to(tl.float32)
        out = w_ptr + rows3 * K + (c * 32)[None, :, None] + j[None, None, :]
        tl.store(out, ((wb & 0xF).to(tl.float32) * s + mn).to(w_ptr.dtype.element_ty), mask=mask)
        tl.store(out + 16, ((wb >> 4).to(tl.float32) * s + mn).to(w_ptr.dtype.element_ty),
                 mask=mask)
    else:
        kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = mask_n[:, None] & (kk < K)[None, :]
        q = tl.load(qw_ptr + offs_n[:, None].to(tl.int64) * K + kk[None, :], mask=mask,
                    other=0).to(tl.float32)
        s = tl.load(s_rows + (kk // G)[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_rows + kk[None, :], (q * s).to(w_ptr.dtype.element_ty), mask=mask)


def _check(fmt: str) -> bool:
    if fmt not in ("q4", "q8"):
        raise ValueError(f"unknown weight layout {fmt!r} (q4 or q8)")
    return fmt == "q4"


def wq_dequant(fmt: str, qweight: torch.Tensor, scales: torch.Tensor,
               mins: torch.Tensor | None, dtype: torch.dtype,
               block: tuple[int, int, int] = DEQUANT_BLOCK) -> torch.Tensor:
    """The weight ``W [N, K]`` of a q4/q8 layout in ``dtype`` (``s * q (+ min)`` in fp32,
    rounded once to ``dtype``): :func:`kernels.quant.reference.dequant` on the device.
    ``block``: rows, weights of K and warps per program."""
    q4 = _check(fmt)
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if q4 else 1)
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_k, warps = block
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _wq_dequant_kernel[grid](qweight, scales, mins if q4 else scales, w, n, k,
                             k // scales.shape[1], Q4=q4, BLOCK_N=block_n, BLOCK_K=block_k,
                             num_warps=warps)
    return w


def wq_config(m: int, n: int, k: int, group: int, device_type: str = "cuda",
              q4: bool = True) -> dict:
    """Launch parameters of :func:`wq_linear`'s kernel (M <= ``DEQUANT_MIN_M``).

    q4, M <= ``GEMV_MAX_M``: the GEMV kernel, 128 weight rows and 128 weights of K per
    program, K in up to 8 parts (the H200 sweep's best). M <= 16: ``16 x 64`` tiles of 128
    weights of K, K split into up to 8 parts so that about
    2048 programs run, 4 warps and 4 stages (the FP8 small-M kernel's rule from its H200
    sweep). Larger M: ``BLOCK_M`` the next power of two up to 64; when the tiles of 64
    columns already make >= 256 programs, 128 columns and no split, else 64 columns with K
    split into up to 4 parts so that about 128 programs run (the FP8 medium-M rule). No
    split on XPU (``kernels/split_k.py``). ``BLOCK_K`` is 128, or 64 for groups that are a
    multiple of 64 but not of 128 (a tile within one group). Not tuned for this kernel yet:
    ``python -m bench.kernels.sweep_gemm_wq --configs`` on a GPU."""
    block_k = 64 if group % 128 and group % 64 == 0 else 128
    trusted = split_k_trusted(device_type)
    k_tiles = triton.cdiv(k, block_k)
    if m <= GEMV_MAX_M and q4 and group % 32 == 0:
        # the H200 sweep (2026-12-02, docs/benchmarks.md): 128 rows, K in 8 parts, 8 warps
        # (4 for the widest weights, gate_up's 28672 rows)
        split = min(8, k_tiles) if trusted else 1
        return dict(GEMV=True, SPLIT_K=split, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=128,
                    BLOCK_K=block_k, **dot_kernel_options(8 if n <= 16384 else 4, 2,
                                                          device_type))
    if m <= SMALL_M_MAX:
        split = max(1, min(8, 2048 // triton.cdiv(n, 64), k_tiles)) if trusted else 1
        return dict(SPLIT_K=split, BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k,
                    **dot_kernel_options(4, 4, device_type))
    block_m = min(64, triton.next_power_of_2(m))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, 64)
    if tiles >= 256:
        return dict(SPLIT_K=1, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=block_k,
                    **dot_kernel_options(8 if block_m >= 64 else 4, 3, device_type))
    split = max(1, min(4, 128 // tiles, k_tiles)) if trusted else 1
    return dict(SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
                **dot_kernel_options(4, 3, device_type))


def wq_linear(x: torch.Tensor, fmt: str, qweight: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T`` -> ``[M, N]`` in x's dtype, W in the ``q4``/``q8`` layout.

    Args:
        x: [M, K] fp16/bf16/fp32, M >= 1.
        qweight, scales, mins: the layout (``scales``/``mins`` ``[N, K/G]`` fp16 or fp32,
            ``G`` a multiple of 32; ``mins`` None for q8).
        config: launch parameters (:func:`wq_config`'s keys) instead of the heuristic; with
            a config the kernel runs at any M (no dequantize-then-GEMM).
    Raises:
        ValueError: an unknown layout, or a split-K launch with more than 65536 blocks of
            output columns.
    """
    q4 = _check(fmt)
    m, k = x.shape
    n = qweight.shape[0]
    group = k // scales.shape[1]
    if config is None and m > DEQUANT_MIN_M:
        return torch.matmul(x, wq_dequant(fmt, qweight, scales, mins, x.dtype).t())
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = dict(config or wq_config(m, n, k, group, x.device.type, q4))
    split = cfg.pop("SPLIT_K", 1)
    gemv = cfg.pop("GEMV", False)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    m_blocks = triton.cdiv(m, cfg["BLOCK_M"])
    n_blocks, k_per_split, part, locks = split_k_launch(y, k, split, cfg["BLOCK_N"],
                                                        cfg["BLOCK_K"], m_blocks)
    grid = (m_blocks, n_blocks, split)
    one = group % cfg["BLOCK_K"] == 0  # every tile of K within one quantization group
    if gemv:
        if not q4 or k % 32:
            raise ValueError("the GEMV kernel takes the q4 layout with K a multiple of 32")
        if m == 1 and cfg["BLOCK_M"] == 1:
            cfg.pop("BLOCK_M")
            _wq_gemv1_kernel[grid](x, qweight.view(torch.int32), scales, mins, y, part, locks,
                                   n, k, group, k_per_split, ONE_GROUP=one, SPLIT_K=split, **cfg)
        else:
            _wq_gemv_kernel[grid](x, qweight.view(torch.int32), scales, mins, y, part, locks, m,
                                  n, k, group, k_per_split, x.stride(0), y.stride(0),
                                  ONE_GROUP=one, SPLIT_K=split, **cfg)
        return y
    _wq_kernel[grid](x, qweight, scales, mins if q4 else scales, y, part, locks, m, n, k,
                     group, k_per_split, x.stride(0), y.stride(0), Q4=q4,
                     ONE_GROUP=one, IEEE=x.dtype == torch.float32,
                     SPLIT_K=split, **cfg)
    return y
