"""Rotary position embedding (RoPE, Su et al. 2021), GPT-NeoX "rotate half" layout.

The head dimension is split in two halves ``x = [x1 | x2]`` rotated pairwise by
``theta_i * pos``: ``[x1 cos - x2 sin | x2 cos + x1 sin]`` (the layout HF Llama/Qwen use).
Frequencies: ``inv_freq_i = base^(-2i/D)``; rope types ``default``, ``linear`` (positions
divided by ``factor``) and ``llama3`` (Llama 3.1 frequency-dependent scaling, from Meta's
reference ``apply_scaling``); ``dynamic``, ``yarn`` and ``longrope`` as transformers computes
them (:mod:`engine.layers.rope_scaling`, with their attention factor on cos/sin), and Gemma 4's
``proportional`` (:func:`proportional_inv_freq`). Variants:
``partial_rotary_factor`` (only the first ``int(D * factor)`` dims of each head rotate) and
the interleaved layout (GLM: pairs ``(0, 1), (2, 3)...`` rotate instead of halves). The cos/sin table is built once in fp32 on the CPU (the same on
every device) and indexed by position each step; the rotation runs in fp32, in
:func:`kernels.reference.rotary_ref` (eager) or :func:`kernels.rotary.rotary_inplace`
(Triton), whichever :func:`engine.layers.select_ops` set as ``impl``.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from engine.layers import rope_scaling
from engine.layers.norm import GemmaRMSNorm, RMSNorm
from kernels.reference import rotary_ref

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope",
                        "proportional")


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
    if params["rope_type"] == "mrope":  # Qwen2-VL's legacy name: default frequencies
        params["rope_type"] = "default"
    if params["rope_type"] in ("su", "yarn") and "short_factor" in params:
        params["rope_type"] = "longrope"          # Phi-3's legacy names (as transformers reads)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None:
        params["partial_rotary_factor"] = float(partial)
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


def linear_scaled_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Linear ("position interpolation") scaling: positions divided by ``params["factor"]``,
    i.e. every inverse frequency [D/2] fp32 divided by it (HF ``linear``; Gemma 3's global
    layers use factor 8 on 27B)."""
    return inv_freq / float(params["factor"])


def proportional_inv_freq(head_dim: int, base: float, params: dict) -> torch.Tensor:
    """Gemma 4's ``proportional`` rope (its global layers): the whole head keeps the
    rotate-half layout, but only the first ``int(partial_rotary_factor * head_dim / 2)``
    frequency pairs turn, at ``base^(-2i / head_dim)`` (the full head size in the exponent),
    divided by ``factor`` (default 1); the other pairs get frequency 0 (cos 1, sin 0: passed
    through). Returns ``[head_dim // 2]`` fp32 on the CPU."""
    angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    inv_freq = torch.zeros(head_dim // 2, dtype=torch.float32, device="cpu")
    inv_freq[:angles] = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64,
                                                     device="cpu").float() / head_dim))
    return inv_freq / float(params.get("factor", 1.0))


def compute_inv_freq(head_dim: int, base: float, params: dict) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 on the CPU.

    ``head_dim`` is the rotated dimension (``rotary_dim`` under a partial rotary). Types
    whose frequencies depend on the context (``dynamic``, ``longrope``) give those of a
    sequence within ``max_position_embeddings`` (``longrope``: the short factors); the
    table (:func:`engine.layers.rope_scaling.cos_sin_table`) handles the rest.

    Raises:
        ValueError: an unsupported rope type (the message lists the supported ones).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
                               .float() / head_dim))
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return linear_scaled_inv_freq(inv_freq, params)
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if rope_type == "dynamic":
        return rope_scaling.dynamic_ntk_inv_freq(head_dim, base, params, None, None)
    if rope_type == "yarn":
        return rope_scaling.yarn_inv_freq(head_dim, base, params, None)[0]
    if rope_type == "longrope":
        return rope_scaling.longrope_inv_freq(head_dim, base, params, short=True)
    if rope_type == "proportional":
        return proportional_inv_freq(head_dim, base, params)
    raise ValueError(f"unsupported rope type {rope_type!r}; ferry supports "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


#: fuse Qwen3/Gemma's per-head q/k norms into the rotary launch where it applies
#: (:meth:`RotaryEmbedding.norm_rotate`); ``FERRY_QK_NORM_ROTARY=0``: separate launches
QK_NORM_ROTARY = os.environ.get("FERRY_QK_NORM_ROTARY", "1") != "0"


class RotaryEmbedding(nn.Module):
    """cos/sin table for positions ``0 .. max_position-1``.

    Args:
        head_dim: the head dimension D (its first ``rotary_dim = int(D *
            partial_rotary_factor)`` dims rotate, an even number).
        max_position: table length in tokens; positions must be below it.
        base: rope theta.
        params: rope parameters (``rope_type``, its fields, ``partial_rotary_factor``), see
            :func:`rope_config`.
        interleaved: rotate pairs ``(0, 1), (2, 3)...`` of the rotated dims (GLM's layout)
            instead of the two halves.
    Raises:
        ValueError: an unsupported rope type, an odd rotary dimension.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, params: dict | None = None,
                 interleaved: bool = False):
        super().__init__()
        params = params or {"rope_type": "default"}
        self.head_dim = head_dim
        # ``proportional`` reads its factor as the share of frequencies that turn, over the
        # whole head (:func:`proportional_inv_freq`)
        partial = 1.0 if params.get("rope_type") == "proportional" \
            else params.get("partial_rotary_factor", 1.0)
        self.rotary_dim = rd = int(head_dim * partial)
        if rd % 2 or rd < 2:
            raise ValueError(f"rotary dimension {rd} (head_dim {head_dim} x partial_rotary_"
                             f"factor) must be even and positive")
        self.interleaved = interleaved
        self.max_position = max_position
        inv_freq = compute_inv_freq(rd, base, params)
        cache = rope_scaling.cos_sin_table(rd, max_position, base, params, inv_freq)  # [P, rd]
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()),
                             persistent=False)
        self.impl = rotary_ref

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq*D] and k [T, Hkv*D] by their positions [T] int64.

        Returns the rotated ``(q, k)`` in their dtypes; use them, not the inputs: the eager
        ``impl`` (:func:`kernels.reference.rotary_ref`) returns new tensors, the fused one
        (:func:`kernels.rotary.rotary_inplace`, one launch for q and k) rotates in place.
        A partial or interleaved rotary rotates a gathered copy of the rotated dims and
        returns new tensors.
        """
        if self.rotary_dim == self.head_dim and not self.interleaved:
            return self.impl(q, k, positions, self.cos_sin_cache, self.head_dim)
        qr, q_pass = self._gather(q)
        kr, k_pass = self._gather(k)
        qr, kr = self.impl(qr, kr, positions, self.cos_sin_cache, self.rotary_dim)
        return self._scatter(qr, q_pass, q.shape), self._scatter(kr, k_pass, k.shape)

    def norm_rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                    q_norm: nn.Module, k_norm: nn.Module
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-head ``q_norm``/``k_norm`` then :meth:`rotate`, in one Triton launch
        (:func:`kernels.rotary.qk_norm_rotary_inplace`, in place) where it applies: this
        class's whole-head rotary on the Triton path and both norms plain per-head
        ``RMSNorm`` or ``GemmaRMSNorm`` on their Triton kernels. ``FERRY_QK_NORM_ROTARY=0``
        turns it off.

        Args:
            q: ``[T, Hq*D]``, k: ``[T, Hkv*D]`` (views of the qkv output allowed).
            positions: ``[T]`` int64.  q_norm, k_norm: the layer's ``[D]`` norms.
        Returns:
            the normed, rotated ``(q, k)``, or None: the caller runs the norms and
            :meth:`rotate` itself.
        """
        if not QK_NORM_ROTARY or type(self).rotate is not RotaryEmbedding.rotate \
                or self.rotary_dim != self.head_dim or self.interleaved \
                or getattr(self.impl, "__module__", None) != "kernels.rotary":
            return None
        kind = type(q_norm)
        if kind not in (RMSNorm, GemmaRMSNorm) or type(k_norm) is not kind \
                or getattr(q_norm.impl, "__module__", None) != "kernels.fused_ops" \
                or getattr(k_norm.impl, "__module__", None) != "kernels.fused_ops" \
                or q_norm.weight.shape != (self.head_dim,) or q_norm.eps != k_norm.eps:
            return None
        from kernels.rotary import qk_norm_rotary_inplace

        return qk_norm_rotary_inplace(q, k, q_norm.weight, k_norm.weight, q_norm.eps,
                                      positions, self.cos_sin_cache, self.head_dim,
                                      zero_centred=kind is GemmaRMSNorm)

    def _gather(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H*D] -> (its rotated dims as a contiguous [T, H*rd], in the halves layout;
        the pass-through dims [T, H, D - rd])."""
        t, rd = x.shape[0], self.rotary_dim
        xh = x.reshape(t, -1, self.head_dim)
        rot = xh[..., :rd]
        if self.interleaved:  # (x0, x1, x2, x3...) -> (x0, x2... | x1, x3...)
            rot = rot.unflatten(-1, (rd // 2, 2)).transpose(-1, -2)
        return rot.reshape(t, -1).contiguous(), xh[..., rd:]

    def _scatter(self, rot: torch.Tensor, rest: torch.Tensor, shape) -> torch.Tensor:
        """The inverse of :meth:`_gather`: a new tensor of ``shape``."""
        t, rd = rot.shape[0], self.rotary_dim
        rot = rot.reshape(t, -1, rd)
        if self.interleaved:
            rot = rot.unflatten(-1, (2, rd // 2)).transpose(-1, -2).flatten(-2)
        return torch.cat([rot, rest], dim=-1).reshape(shape)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, rotary_dim/2] fp32."""
        cs = self.cos_sin_cache.index_select(0, positions)
        return cs.chunk(2, dim=-1)


class NoRotary(nn.Module):
    """The rotary of a layer without position embedding (NoPE: SmolLM3's and EXAONE 4's
    global layers): :meth:`rotate` returns q and k as they are."""

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq*D], k [T, Hkv*D], positions [T] -> the same ``(q, k)``, not rotated."""
        return q, k

    def norm_rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                    q_norm: nn.Module, k_norm: nn.Module) -> None:
        """None: no rotary to fuse the norms into (the caller runs them)."""
        return None


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): each token has three positions (temporal,
    height, width) and frequency ``i`` of the ``D/2`` rotates by the position of the axis
    whose section holds it (``mrope_section``, e.g. ``[16, 24, 24]``: the first 16
    frequencies the temporal position, the next 24 the height, the last 24 the width; with
    ``mrope_interleaved`` (Qwen3-VL) frequencies ``1, 4, 7...`` (``section[1]`` of them) the
    height, ``2, 5, 8...`` (``section[2]``) the width, the rest the temporal one).
    A token whose three positions are equal (all text) rotates as plain RoPE at that
    position, so ``rotate`` with ``[T]`` positions is :class:`RotaryEmbedding`'s.

    Args:
        head_dim, max_position, base, params: as :class:`RotaryEmbedding` (a partial rotary,
            Qwen3.5's, applies the sections to its ``rd = rotary_dim`` rotated dims);
            ``params["mrope_section"]``: three section sizes summing to ``rd/2`` (any
            sizes when interleaved: frequencies past ``rd/2`` are dropped, as HF does).
    Raises:
        ValueError: not three sections, or (not interleaved) sections that do not sum to
            ``rd/2``.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, params: dict):
        super().__init__(head_dim, max_position, base, params)
        section = [int(x) for x in params.get("mrope_section") or ()]
        half = self.rotary_dim // 2
        # interleaved: HF slices the frequencies by the sections (whatever their sum)
        if len(section) != 3 or (sum(section) != half
                                 and not params.get("mrope_interleaved")):
            raise ValueError(f"mrope_section {section} must be three sizes summing to "
                             f"rotary_dim / 2 = {half}")
        if params.get("mrope_interleaved"):  # Qwen3-VL: t h w t h w ... t t t
            axis = torch.zeros(half, dtype=torch.int64, device="cpu")
            axis[1:section[1] * 3:3] = 1
            axis[2:section[2] * 3:3] = 2
        else:
            axis = torch.repeat_interleave(torch.arange(3, device="cpu"),
                                           torch.tensor(section, device="cpu"))  # [D/2]
        mask = torch.nn.functional.one_hot(axis, 3).T.to(torch.float32)        # [3, rd/2]
        self.register_buffer("axis_mask", mask.repeat(1, 2).unsqueeze(1)
                             .to(torch.get_default_device()), persistent=False)  # [3, 1, rd]

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq*D] and k [T, Hkv*D] by positions [T] (plain RoPE) or [3, T]
        int64 (temporal, height, width); returns the rotated ``(q, k)`` (see
        :meth:`RotaryEmbedding.rotate`)."""
        if positions.dim() == 1:
            return super().rotate(q, k, positions)
        t = positions.shape[1]
        table = self.cos_sin_cache[positions]                 # [3, T, rd] fp32
        cos_sin = (table * self.axis_mask).sum(dim=0)         # each column from its axis
        rows = torch.arange(t, device=positions.device)
        if self.rotary_dim == self.head_dim:
            return self.impl(q, k, rows, cos_sin, self.head_dim)
        qr, q_pass = self._gather(q)
        kr, k_pass = self._gather(k)
        qr, kr = self.impl(qr, kr, rows, cos_sin, self.rotary_dim)
        return self._scatter(qr, q_pass, q.shape), self._scatter(kr, k_pass, k.shape)
