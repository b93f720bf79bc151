"""RoPE scaling types whose frequencies or magnitudes go beyond a per-frequency factor:
``dynamic`` (dynamic NTK), ``yarn`` and ``longrope`` (Phi-3/3.5), each computed as
transformers' ``ROPE_INIT_FUNCTIONS`` computes it, and :func:`cos_sin_table`, the fp32
``[cos | sin]`` table of :class:`engine.layers.rotary.RotaryEmbedding` for any rope type.

``dim`` below is the rotated dimension (``int(head_dim * partial_rotary_factor)``), ``base``
the rope theta, ``params`` the config's ``rope_parameters`` (``rope_type`` and its fields),
``max_position`` the model's ``max_position_embeddings`` (the table length).

Context-dependent types, and what ferry does with them (positions are below
``max_position`` in ferry):

- ``dynamic``: transformers recomputes the base when a forward's longest position passes
  ``max_position_embeddings``; below it the frequencies are the default ones, and so is
  ferry's table (it never passes it).
- ``longrope``: transformers picks ``long_factor`` for a whole forward when its longest
  position + 1 exceeds ``original_max_position_embeddings``, else ``short_factor`` (keys
  cached by earlier forwards keep the rotation they had). ferry rotates each token by its
  own position's set: short below ``original_max_position_embeddings``, long from it on.
  For every sequence that stays within ``original_max_position_embeddings`` the two agree
  exactly (short throughout); beyond it ferry's keys do not depend on how the sequence was
  split into forwards. The attention factor (``sqrt(1 + ln(factor) / ln(original))``
  unless given) scales cos and sin in both ranges, as in transformers.
- ``yarn``: context-independent; its attention factor (mscale) scales cos and sin.
"""

from __future__ import annotations

import math

import torch


def _exponents(dim: int) -> torch.Tensor:
    """``2i / dim`` for ``i < dim // 2``, fp32 on the CPU."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def dynamic_ntk_inv_freq(dim: int, base: float, params: dict, max_position: int | None,
                         seq_len: int | None) -> torch.Tensor:
    """Dynamic NTK inverse frequencies ``[dim // 2]`` fp32 for a sequence of ``seq_len``
    tokens: the base grows as ``base * (factor * L / M - (factor - 1)) ^ (dim / (dim - 2))``
    with ``L = max(seq_len, M)``, ``M = max_position`` (None or ``seq_len`` None: ``L = M``,
    the default frequencies)."""
    factor = float(params["factor"])
    if max_position is not None and seq_len is not None and seq_len > max_position:
        base = base * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: dict, max_position: int | None) -> float:
    """YaRN's cos/sin magnitude: ``attention_factor`` if given, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
    ``0.1 ln(factor) + 1`` (1 for ``factor <= 1``)."""
    factor = _yarn_factor(params, max_position)
    given = params.get("attention_factor")
    if given is not None:
        return float(given)
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
    return _yarn_mscale(factor)


def _yarn_factor(params: dict, max_position: int | None) -> float:
    factor = params.get("factor")
    if factor is None:
        factor = max_position / params["original_max_position_embeddings"]
    return float(factor)


def yarn_inv_freq(dim: int, base: float, params: dict, max_position: int | None
                  ) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): ``(inv_freq [dim // 2] fp32, attention factor)``.

    Frequencies above the ``beta_fast`` rotation count (within
    ``original_max_position_embeddings``) extrapolate, those below ``beta_slow`` interpolate
    (divided by ``factor``), a linear ramp between (``truncate``: the ramp ends rounded out
    to whole dims, default True).
    """
    factor = _yarn_factor(params, max_position)
    original = params["original_max_position_embeddings"]
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** _exponents(dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, yarn_attention_factor(params, max_position)


def longrope_inv_freq(dim: int, base: float, params: dict, short: bool) -> torch.Tensor:
    """LongRoPE inverse frequencies ``[dim // 2]`` fp32: ``1 / (ext_i * base^(2i/dim))`` with
    ``ext`` the ``short_factor`` list (``short``) or the ``long_factor`` list.

    Raises:
        ValueError: a factor list whose length is not ``dim // 2``.
    """
    ext = params["short_factor" if short else "long_factor"]
    if len(ext) != dim // 2:
        raise ValueError(f"longrope {'short' if short else 'long'}_factor has {len(ext)} "
                         f"entries; the rotary dimension {dim} needs {dim // 2}")
    return 1.0 / (torch.tensor(ext, dtype=torch.float32, device="cpu") * base ** _exponents(dim))


def longrope_attention_factor(params: dict, max_position: int) -> float:
    """LongRoPE's cos/sin magnitude: ``attention_factor`` if given, else
    ``sqrt(1 + ln(factor) / ln(original))`` (1 for ``factor <= 1``), ``factor`` defaulting
    to ``max_position / original_max_position_embeddings``."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    given = params.get("attention_factor")
    if given is not None:
        return float(given)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    return torch.outer(positions, inv_freq)


def cos_sin_table(dim: int, max_position: int, base: float, params: dict,
                  inv_freq: torch.Tensor) -> torch.Tensor:
    """``[max_position, dim]`` fp32 ``[cos | sin]`` of ``position * inv_freq``, times the rope
    type's attention factor (yarn, longrope); longrope's rows from
    ``original_max_position_embeddings`` on use the long factors (module docstring).

    Args:
        inv_freq: ``[dim // 2]`` fp32, :func:`engine.layers.rotary.compute_inv_freq`'s.
    """
    t = torch.arange(max_position, dtype=torch.float32, device="cpu")
    rope_type = params.get("rope_type", "default")
    freqs = _angles(t, inv_freq)                                   # [P, dim/2]
    scale = 1.0
    if rope_type == "yarn":
        scale = yarn_attention_factor(params, max_position)
    elif rope_type == "longrope":
        scale = longrope_attention_factor(params, max_position)
        original = int(params["original_max_position_embeddings"])
        if max_position > original:
            long_freq = longrope_inv_freq(dim, base, params, short=False)
            freqs[original:] = _angles(t[original:], long_freq)
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
