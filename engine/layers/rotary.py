"""Rotary position embedding (RoPE, Su et al. 2021), GPT-NeoX "rotate half" layout.

The head dimension is split in two halves ``x = [x1 | x2]`` rotated pairwise by
``theta_i * pos``: ``[x1 cos - x2 sin | x2 cos + x1 sin]`` (the layout HF Llama/Qwen use).
Frequencies: ``inv_freq_i = base^(-2i/D)``; rope types ``default``, ``linear`` (positions
divided by ``factor``), ``llama3`` (Llama 3.1 frequency-dependent scaling, from Meta's
reference ``apply_scaling``) and ``yarn`` (YaRN's ramp between interpolated and original
frequencies, its magnitude on cos/sin: :func:`yarn_attention_factor`, DeepSeek's
``mscale``/``mscale_all_dim`` ratio included). The cos/sin table is built once in fp32 on the CPU (the same on
every device) and indexed by position each step; the rotation runs in fp32, in
:func:`kernels.reference.rotary_ref` (eager) or :func:`kernels.rotary.rotary_inplace`
(Triton), whichever :func:`engine.layers.select_ops` set as ``impl``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels.reference import rotary_ref

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_config(config) -> tuple[float, dict]:
    """``(rope_theta, rope_parameters)`` from an HF config.

    Reads ``config.rope_parameters`` (transformers 5) and falls back to ``config.rope_theta``
    and ``config.rope_scaling`` (older configs). The returned dict always has ``rope_type``.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return float(theta), params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_ctx = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(head_dim: int, base: float, params: dict) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023; transformers' ``_compute_yarn_parameters``):
    original ones below ``beta_fast`` rotations over the pre-training context, ``factor``
    times slower ones above ``beta_slow``, a linear ramp between."""
    factor = float(params["factor"])
    old_ctx = float(params["original_max_position_embeddings"])
    fast, slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ramp = ramp.clamp(0, 1)
    pos = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    keep = 1 - ramp                               # the share of the original frequency
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def yarn_attention_factor(params: dict) -> float:
    """The magnitude YaRN puts on cos/sin (1.0 for other rope types): ``attention_factor``,
    else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given
    (DeepSeek), else ``mscale(factor)``, with ``mscale(s, m) = 0.1 m ln s + 1``."""
    if params.get("rope_type") != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return _yarn_mscale(factor, float(m)) / _yarn_mscale(factor, float(m_all))
    return _yarn_mscale(factor)


def compute_inv_freq(head_dim: int, base: float, params: dict) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 on the CPU.

    Raises:
        ValueError: a rope type other than default, linear, llama3 or yarn.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
                               .float() / head_dim))
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, params)
    raise ValueError(f"unsupported rope type {rope_type!r}; ferry supports "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """cos/sin table for positions ``0 .. max_position-1``.

    Args:
        head_dim: rotated dimension D (even).
        max_position: table length in tokens; positions must be below it.
        base: rope theta.
        params: rope parameters (``rope_type`` and its fields), see :func:`rope_config`.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, params: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(head_dim, base, params or {"rope_type": "default"})
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)                         # [P, D/2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)    # [P, D] fp32
        factor = yarn_attention_factor(params or {})
        if factor != 1.0:
            cache = cache * factor
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()),
                             persistent=False)
        self.impl = rotary_ref

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq*D] and k [T, Hkv*D] by their positions [T] int64.

        Returns the rotated ``(q, k)`` in their dtypes; use them, not the inputs: the eager
        ``impl`` (:func:`kernels.reference.rotary_ref`) returns new tensors, the fused one
        (:func:`kernels.rotary.rotary_inplace`, one launch for q and k) rotates in place.
        """
        return self.impl(q, k, positions, self.cos_sin_cache, self.head_dim)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, D/2] fp32."""
        cs = self.cos_sin_cache.index_select(0, positions)
        return cs.chunk(2, dim=-1)


class NoRotary(nn.Module):
    """The rotary of a layer without position embedding (NoPE: SmolLM3's and EXAONE 4's
    global layers): :meth:`rotate` returns q and k as they are."""

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq*D], k [T, Hkv*D], positions [T] -> the same ``(q, k)``, not rotated."""
        return q, k
