"""The torch references of the FP8 kernels (:mod:`kernels.fp8.fp8_triton`): per-row e4m3
quantization and the two FP8 matmuls with upcast operands. The CPU runs them, the GPUs where
a Triton kernel or ``torch._scaled_mm`` is missing, and the tests compare the kernels with them.
No Triton import.
"""

from __future__ import annotations

import torch

from kernels.fp8.constants import FP8_DTYPE, FP8_MAX, SCALE_EPS


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric e4m3 quantization, one scale per row (the torch reference).

    Args:
        x: [M, K], any float dtype.
    Returns:
        ``(xq [M, K] float8_e4m3fn, scale [M, 1] float32)`` with
        ``scale = max(amax_k |x|, 1e-12) / 448`` and ``xq = fp8(clamp(x / scale, ±448))``,
        so ``xq * scale`` approximates ``x``.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_EPS) / FP8_MAX
    xq = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


def fp8_matmul_dequant(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor,
                       sw: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """``(xq @ wq^T) * sx * sw^T`` with the e4m3 operands upcast to ``compute_dtype``.

    Args:
        xq: [M, K] e4m3; sx: [M, 1] fp32; wq: [N, K] e4m3; sw: [N] fp32.
    Returns:
        [M, N] float32.
    """
    acc = torch.matmul(xq.to(compute_dtype), wq.to(compute_dtype).t())
    return acc.float() * sx * sw


def fp8_matmul_weight_only(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                           compute_dtype: torch.dtype) -> torch.Tensor:
    """``(x @ wq^T) * sw^T`` with the e4m3 weights upcast to ``compute_dtype``.

    Args:
        x: [M, K] float; wq: [N, K] e4m3 (or its exact upcast); sw: [N] fp32.
    Returns:
        [M, N] float32.
    """
    acc = torch.matmul(x.to(compute_dtype), wq.to(compute_dtype).t())
    return acc.float() * sw
