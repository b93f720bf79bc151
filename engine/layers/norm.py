"""RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add.

Matches HF ``LlamaRMSNorm``: the statistics are computed in fp32, the normalised value is
cast back to the input dtype and then scaled by ``weight``. The math lives in
:func:`kernels.reference.rms_norm_ref` (eager) and :func:`kernels.fused_ops.rms_norm`
(Triton); :func:`engine.layers.select_ops` sets which one ``impl`` is.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.reference import gated_rms_norm_ref, gemma_rms_norm_ref, rms_norm_ref


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


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a feature dimension split over the tensor-parallel ranks.

    OLMoE normalises the whole q (and k) projection, ``num_heads * head_dim`` features, while
    each rank holds only its heads' columns. Rank r keeps ``weight[r*n : (r+1)*n]`` (``n =
    full_size / tp_size / replicas`` columns; with ``replicas`` > 1, the KV-head case, groups
    of ``replicas`` ranks hold the same columns) and the mean square is the all-reduced sum of
    squares (each column counted ``replicas`` times) over ``full_size``. At tp_size=1 it is a
    plain :class:`RMSNorm` (and takes the selected ``impl``).
    """

    def __init__(self, full_size: int, eps: float, dtype: torch.dtype, replicas: int = 1,
                 tp_size: int | None = None, tp_rank: int | None = None):
        from engine.distributed import get_tp

        g = get_tp()
        self.tp_size = g.size if tp_size is None else tp_size
        self.tp_rank = g.rank if tp_rank is None else tp_rank
        self.replicas = replicas
        self.full_size = full_size
        parts = self.tp_size // replicas
        if full_size % parts:
            raise ValueError(f"norm size {full_size} does not split over {parts} ranks")
        super().__init__(full_size // parts, eps, dtype)
        self.weight.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., full_size / parts] (this rank's columns) -> normed, same shape."""
        if self.tp_size == 1:
            return super().forward(x, residual)
        from engine.distributed import all_reduce

        if residual is not None:
            raise ValueError("ShardedRMSNorm has no fused residual add")
        xf = x.float()
        ss = all_reduce(xf.pow(2).sum(-1, keepdim=True))
        y = xf * torch.rsqrt(ss / (self.full_size * self.replicas) + self.eps)
        return self.weight * y.to(x.dtype)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.full_size,):
            raise ValueError(f"ShardedRMSNorm: checkpoint tensor has shape "
                             f"{tuple(loaded.shape)}, expected {(self.full_size,)}")
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, (self.tp_rank // self.replicas) * n, n))


class GatedRMSNorm(nn.Module):
    """Qwen3-Next's gated RMSNorm (HF ``Qwen3NextRMSNormGated``): per head,
    ``weight * rmsnorm(x) * silu(gate)``; the statistics and the gate in fp32, the normed
    value cast back to x's dtype before ``weight``.

    ``impl`` is :func:`kernels.reference.gated_rms_norm_ref` (the default, and the CPU's) or
    the fused Triton kernel :func:`kernels.fused_ops.gated_rms_norm`
    (:func:`engine.layers.select_ops`).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.impl = gated_rms_norm_ref

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [..., D] and gate (same shape, last axis unit stride for the Triton kernel,
        which raises ValueError otherwise) -> new [..., D] tensor in x's dtype."""
        return self.impl(x, gate, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in fp32, then
    cast to x's dtype (HF ``Gemma2RMSNorm``/``Gemma3RMSNorm``, and Qwen3-Next's
    ``Qwen3NextRMSNorm``: the checkpoint's weight is zero-centred, and the scale is applied
    before the cast, unlike :class:`RMSNorm`).

    Args:
        hidden_size: normalised width H.
        eps: added to the mean square.
        dtype: parameter dtype (the weight starts at zero: the identity scale).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.impl = gemma_rms_norm_ref

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., H] -> normed [..., H] in x's dtype; with ``residual`` (same shape and
        dtype) ``(norm(x + residual), x + residual)``. Out-of-place; ``impl`` is
        :func:`kernels.reference.gemma_rms_norm_ref` or the fused Triton kernel
        (:func:`engine.layers.select_ops`)."""
        return self.impl(x, self.weight, self.eps, residual)


class UnitRMSNorm(nn.Module):
    """RMSNorm without a weight (HF ``Gemma4RMSNorm(with_scale=False)``: Gemma 4's v norm
    and router norm): ``x / sqrt(mean(x^2) + eps)`` in fp32, cast to x's dtype.

    ``forward(x [..., H]) -> [..., H]`` in x's dtype (a new tensor).
    """

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


# Qwen3-Next's name for the same (1 + w) norm.
ZeroCenteredRMSNorm = GemmaRMSNorm
