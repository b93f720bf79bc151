"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import fused_ops_on


class SiluAndMul(nn.Module):
    """SwiGLU (Shazeer 2020): x [..., 2*d] = [gate | up] -> silu(gate) * up [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops_on(x):
            from kernels.fused_ops import silu_and_mul

            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
