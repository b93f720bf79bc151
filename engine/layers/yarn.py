"""YaRN rotary scaling (Peng et al. 2023), as transformers 5.24's ``_compute_yarn_parameters``
computes it (gpt-oss's ``rope_type: yarn``).

Kept apart from :mod:`engine.layers.rotary` (whose rope types are added there in parallel):
:func:`yarn_inv_freq` gives the blended inverse frequencies and the attention factor that
multiplies cos and sin; :class:`YarnRotaryEmbedding` is a
:class:`engine.layers.rotary.RotaryEmbedding` whose cos/sin table carries both.
"""

from __future__ import annotations

import math

import torch

from engine.layers.rotary import RotaryEmbedding


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(head_dim: int, base: float, params: dict,
                  max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies ``[head_dim // 2]`` fp32 (CPU) and the attention factor.

    Args:
        head_dim: rotated dimension D (even).
        base: rope theta.
        params: the rope parameters: ``factor`` (None: ``max_position /
            original_max_position_embeddings``), ``original_max_position_embeddings``,
            optional ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``beta_fast``
            (32), ``beta_slow`` (1), ``truncate`` (True).
        max_position: the model's ``max_position_embeddings`` (only for a missing factor).
    Raises:
        KeyError: no ``original_max_position_embeddings``.
    """
    old_ctx = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position / old_ctx
    attn = params.get("attention_factor")
    if attn is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = (_mscale(factor, ms) / _mscale(factor, ms_all) if ms and ms_all
                else _mscale(factor))
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def corr_dim(rotations: float) -> float:
        return (head_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
                        / head_dim)
    extra = 1.0 - ramp                         # the share of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, float(attn)


class YarnRotaryEmbedding(RotaryEmbedding):
    """A rotary table with YaRN frequencies, cos and sin scaled by the attention factor
    (transformers multiplies both by it); otherwise :class:`RotaryEmbedding`.

    Args:
        head_dim, max_position, base: as :class:`RotaryEmbedding`.
        params: the YaRN parameters (see :func:`yarn_inv_freq`).
    """

    def __init__(self, head_dim: int, max_position: int, base: float, params: dict):
        super().__init__(head_dim, 1, base)
        inv_freq, attn = yarn_inv_freq(head_dim, base, params, max_position)
        self.max_position = max_position
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat([freqs.cos() * attn, freqs.sin() * attn], dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()),
                             persistent=False)


__all__ = ["YarnRotaryEmbedding", "yarn_inv_freq"]
