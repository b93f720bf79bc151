"""Per-token e4m3 quantization of activations in one Triton program per row.

The torch reference (:func:`engine.layers.quantization.fp8.quantize_rows`) is five kernels
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

from engine.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, SCALE_EPS


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
