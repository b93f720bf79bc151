"""RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add.

Matches HF ``LlamaRMSNorm``: the statistics are computed in fp32, the normalised value is
cast back to the input dtype and then scaled by ``weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import fused_ops_on


class RMSNorm(nn.Module):
    """``y = weight * x / sqrt(mean(x^2) + eps)`` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` [..., hidden].

        Without ``residual`` returns the normed tensor. With ``residual`` (same shape/dtype)
        returns ``(norm(x + residual), x + residual)``: the sum is the new residual stream.
        """
        if fused_ops_on(x):
            from kernels.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
