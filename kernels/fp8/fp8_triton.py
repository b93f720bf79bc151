"""FP8 Triton kernels: per-token e4m3 quantization of activations in one program per row,
and the small/medium-M FP8 linear (the decode GEMV-like matmul); their torch references are in
:mod:`kernels.fp8.reference`, the numbers they share with the FP8 layers in
:mod:`kernels.fp8.constants`.

The torch reference (:func:`kernels.fp8.reference.quantize_rows`) is five kernels
(upcast, abs, amax, divide, clamp-and-cast); at decode batch sizes each FP8 linear layer
would pay their launch latency. This kernel reads the row once into registers, takes its
amax, and writes the e4m3 row and its fp32 scale: the same formula. Triton's fp32 division
may be approximate (within 2 ulp, depending on the Triton version and backend), so a scale
can differ from torch's in its last bit and a code that sits on a rounding midpoint can go
the other way: a few codes in a million. (The Triton CPU interpreter rounds fp8 casts near
powers of two differently; check the codes on a device.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8.constants import FP8_DTYPE, FP8_MAX, SCALE_EPS, WEIGHT_ONLY_MAX_M
from kernels.launch import dot_kernel_options
from kernels.split_k import (  # noqa: F401 - split_k_locks/trusted re-exported
    split_k_launch,
    split_k_locks,
    split_k_trusted,
)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, K,
                          FMAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 0), EPS)
    scale = amax / FMAX
    q = x / scale
    q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``quantize_rows``.

    Args:
        x: [M, K] float (row stride arbitrary, unit column stride), M >= 1.
    Returns:
        ``(xq [M, K] float8_e4m3fn row-major, scale [M, 1] float32)``.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    _quantize_rows_kernel[(m,)](x, q, s, x.stride(0), q.stride(0), k, FMAX=FP8_MAX,
                                EPS=SCALE_EPS, BLOCK=block, num_warps=warps)
    return q, s


# ---- small-M FP8 linear (decode) ---------------------------------------------------------
#
# At decode batch sizes a linear layer is a weight read: y = x W^T with M <= 16 rows of x
# and N x K bytes of e4m3 weights. torch._scaled_mm runs cuBLASLt's FP8 GEMM there, which is
# tuned for large M and streams the weights well below the copy bandwidth, and it needs the
# activations quantized by a separate kernel first. This kernel streams each weight tile once
# (split over K when N alone gives too few programs) and upcasts it in registers. The layers
# call it weight-only (``quant_x=False``, see WEIGHT_ONLY_MAX_M in constants.py and
# engine/layers/quantization/fp8.py); ``quant_x=True`` quantizes x per token inside the kernel (the per-token scale is the amax of the row, a
# first pass over x) and multiplies the exact e4m3 codes in fp16 (every e4m3 value is exact
# in fp16, so each product is exact in the fp32 accumulator): the numerics of
# ``quantize_rows`` + ``_scaled_mm`` up to the order of the fp32 sums, kept for the
# benchmark and the tests (the serial amax pass made it 1.5-2x slower than weight-only).

@triton.jit
def _fp8_small_m_kernel(x_ptr, w_ptr, sw_ptr, sx_ptr, y_ptr, part_ptr, lock_ptr, M, N, K,
                        k_per_split, stride_xm, stride_wn, stride_ym,
                        FMAX: tl.constexpr, EPS: tl.constexpr, QUANT_X: tl.constexpr,
                        X_FP8: tl.constexpr,
                        USE_DOT: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if X_FP8:     # x holds e4m3 codes already, sx_ptr their per-token scales
        sx = tl.load(sx_ptr + offs_m, mask=m_mask, other=0.0)
    elif QUANT_X:  # per-token scale: the amax of the whole row, whatever this program's K part
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            xa = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < K),
                         other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xa), axis=1))
        sx = tl.maximum(amax, EPS) / FMAX
    else:
        sx = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if X_FP8:     # e4m3 x e4m3 tensor-core dot, fp32 accumulation
            xd = x
            wd = w
        elif QUANT_X:
            q = x.to(tl.float32) / sx[:, None]
            q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
            xd = q.to(tl.float8e4nv).to(tl.float16)
            wd = w.to(tl.float16)
        else:
            xd = x
            wd = w.to(x.dtype)
        if USE_DOT:
            if IEEE:
                acc += tl.dot(xd, tl.trans(wd), input_precision="ieee")
            else:
                acc += tl.dot(xd, tl.trans(wd))
        else:
            acc += tl.sum(xd.to(tl.float32)[:, None, :] * wd.to(tl.float32)[None, :, :], axis=2)
    sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc * sx[:, None] * sw[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # each K part writes its fp32 partial; the last of the SPLIT_K programs of this N
        # block to arrive (a counter per N block) sums them in K order and writes y, then
        # resets the counter for the next launch (so a graph replay finds it at 0)
        mn = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + mn, y, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + mn, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")


#: the largest M the layers give the small-M kernel (``WEIGHT_ONLY_MAX_M``): at M = 32
#: quant + ``torch._scaled_mm`` is already as fast (bench/kernels/sweep_gemm.py --fp8 on the H200)
SMALL_M_MAX = WEIGHT_ONLY_MAX_M


def small_m_config(m: int, n: int, k: int, device_type: str = "cuda") -> dict:
    """Launch parameters for :func:`fp8_linear_small_m`, from ``bench.kernels.sweep_gemm --fp8`` on
    the H200 (2026-12-01, weight-only, M = 1 and 16; the best config per Llama-3-8B shape
    was within 3% of this rule): 64 output columns x 128 K per tile, 4 stages, and K split
    into up to 8 parts so that about 2048 programs stream the weights. XPU: no split
    (:func:`split_k_trusted`), and twice the warps with 2 stages (``kernels/launch.py``)."""
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 64
    split = max(1, min(8, 2048 // triton.cdiv(n, block_n))) if split_k_trusted(device_type) else 1
    return dict(USE_DOT=True, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128,
                **dot_kernel_options(4, 4, device_type))


def medium_m_config(m: int, n: int, k: int, device_type: str = "cuda") -> dict:
    """Launch parameters of the FP8-dot mode (``fp8_linear_fp8_dot``, 16 < M <= 64), from
    ``bench.kernels.sweep_gemm --fp8-medium`` on the H200 (2026-12-01; 48 configs per shape at M = 32
    and 64; this rule is the best config or within 12% of it on every Llama-3-8B shape):
    wide layers (>= 256 blocks of 64 columns) take 128 x 128 tiles without split; the others
    64 columns x 256 K, K split so that about 128 programs run (at most 4 parts). XPU (not
    used there today: ``engine.device.triton_fp8_mma``): as :func:`small_m_config`."""
    block_m = max(16, triton.next_power_of_2(m))
    opts = dot_kernel_options(4, 4, device_type)
    if triton.cdiv(n, 64) >= 256:
        return dict(USE_DOT=True, SPLIT_K=1, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, **opts)
    split = max(1, min(4, 128 // triton.cdiv(n, 64))) if split_k_trusted(device_type) else 1
    return dict(USE_DOT=True, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=256, **opts)


def fp8_linear_small_m(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                       quant_x: bool = True, out_dtype: torch.dtype | None = None,
                       config: dict | None = None,
                       x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x Wq^T`` for small M with e4m3 weights streamed once.

    Args:
        x: [M, K] bf16/fp16/fp32, unit column stride, M >= 1.
        wq: [N, K] float8_e4m3fn, row-major.
        sw: [N] fp32 per-output-channel weight scales.
        quant_x: quantize x per token to e4m3 inside the kernel (W8A8, the numerics of
            ``quantize_rows`` + ``torch._scaled_mm``); False multiplies x as it is (W8A16).
        out_dtype: default x's dtype.
        config: launch parameters (``small_m_config``'s keys); default from it.
        x_scale: [M, 1] fp32 per-token scales when ``x`` already holds e4m3 codes (from
            ``quantize_rows``/``quantize_rows_triton``): the kernel then multiplies the codes
            on the FP8 tensor cores (``tl.dot`` of e4m3 operands, GPUs with FP8 MMA only;
            ``quant_x`` is ignored). ``out_dtype`` is then required.
    Returns:
        [M, N] in ``out_dtype``: ``(q(x) @ Wq^T) * sx * sw^T``, fp32 accumulation. With
        ``SPLIT_K`` > 1 the K parts are summed in a fixed order (deterministic).
    Raises:
        ValueError: more than 65536 blocks of ``BLOCK_N`` output columns with split K.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = wq.shape[0]
    x_fp8 = x_scale is not None
    if x_fp8 and out_dtype is None:
        raise ValueError("x_scale (e4m3 input codes) needs an out_dtype")
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    cfg = dict(config or small_m_config(m, n, k, x.device.type))
    split = cfg.setdefault("SPLIT_K", 1)
    n_blocks, k_per_split, part, locks = split_k_launch(y, k, split, cfg["BLOCK_N"],
                                                        cfg["BLOCK_K"])
    _fp8_small_m_kernel[(n_blocks, split)](
        x, wq, sw, x_scale if x_fp8 else sw, y, part, locks, m, n, k, k_per_split,
        x.stride(0), wq.stride(0), y.stride(0), FMAX=FP8_MAX, EPS=SCALE_EPS,
        QUANT_X=quant_x and not x_fp8, X_FP8=x_fp8,
        IEEE=(not quant_x and not x_fp8 and x.dtype == torch.float32), **cfg)
    return y


def fp8_linear_fp8_dot(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                       config: dict | None = None) -> torch.Tensor:
    """W8A8 for medium M (decode batches of 17-64 rows): ``quantize_rows_triton`` then the
    small-M kernel on the FP8 tensor cores (the numerics of quant + ``torch._scaled_mm``,
    up to the order of the fp32 sums). x [M, K] bf16/fp16 -> [M, N] in x's dtype."""
    xq, sx = quantize_rows_triton(x)
    m, k = x.shape
    return fp8_linear_small_m(xq, wq, sw, out_dtype=x.dtype, x_scale=sx,
                              config=config or medium_m_config(m, wq.shape[0], k,
                                                               x.device.type))
