"""Gated activations: ``act(gate) * up`` over a fused ``[gate | up]`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class GeluTanhAndMul(nn.Module):
    """GeGLU with the tanh approximation of GeLU (Gemma's ``gelu_pytorch_tanh``):
    x [..., 2*d] = [gate | up] -> gelu_tanh(gate) * up [..., d], in x's dtype (as HF's
    ``act_fn(gate_proj(x)) * up_proj(x)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2*d] -> new [..., d] in x's dtype."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


#: HF ``hidden_act`` / ``hidden_activation`` name -> gated activation class
GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
}


def gated_activation(name: str) -> nn.Module:
    """The gated activation module of HF activation ``name``.

    Raises:
        ValueError: a name not in :data:`GATED_ACTIVATIONS` (the message lists them).
    """
    cls = GATED_ACTIVATIONS.get(name)
    if cls is None:
        raise ValueError(f"unsupported hidden_act {name!r}; ferry supports "
                         f"{', '.join(sorted(GATED_ACTIVATIONS))}")
    return cls()
