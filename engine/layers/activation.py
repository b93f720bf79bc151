"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from kernels.reference import silu_and_mul_ref


class SiluAndMul(nn.Module):
    """SwiGLU (Shazeer 2020): x [..., 2*d] = [gate | up] -> silu(gate) * up [..., d].

    ``impl`` is :func:`kernels.reference.silu_and_mul_ref` until
    :func:`engine.layers.select_ops` picks the Triton ``silu_and_mul``; both return a new
    tensor in x's dtype.
    """

    def __init__(self):
        super().__init__()
        self.impl = silu_and_mul_ref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2*d] -> new [..., d] in x's dtype."""
        return self.impl(x)
