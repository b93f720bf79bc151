"""RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add.

Matches HF ``LlamaRMSNorm``: the statistics are computed in fp32, the normalised value is
cast back to the input dtype and then scaled by ``weight``. The math lives in
:func:`kernels.reference.rms_norm_ref` (eager) and :func:`kernels.fused_ops.rms_norm`
(Triton); :func:`engine.layers.select_ops` sets which one ``impl`` is.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.reference import rms_norm_ref


class RMSNorm(nn.Module):
    """``y = weight * x / sqrt(mean(x^2) + eps)`` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.impl = rms_norm_ref

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` [..., hidden].

        Without ``residual`` returns the normed tensor. With ``residual`` (same shape/dtype)
        returns ``(norm(x + residual), x + residual)``: the sum is the new residual stream.
        Out-of-place with either implementation: new tensors, ``x`` and ``residual`` are
        not written.
        """
        return self.impl(x, self.weight, self.eps, residual)
