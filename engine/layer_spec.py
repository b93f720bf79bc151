"""``LayerSpec``: what one decoder layer's attention is and what it keeps between steps.

A model describes each of its layers with one frozen :class:`LayerSpec`
(:meth:`engine.models.base.CausalLM.layer_specs`); the readers act on that description
instead of on the model's class:

- the KV pool (:func:`engine.kv.pool.build_kv_pool`) groups the layers by
  :class:`CacheKind` and builds the store of each group (today the paged K/V pool of the
  ``PAGED_KV`` layers; the other kinds are refused by name);
- the attention layer (:class:`engine.layers.attention.Attention`) holds its layer's spec
  and hands it to the step's backend (:class:`engine.attention.base.AttentionBackend`),
  which checks every layer's spec when it is built, so a windowed, soft-capped, latent or
  linear layer that no kernel runs yet is refused at start-up with one line, never run
  wrong.

This module sits at the bottom of engine/ (beside ``forward_batch``): the KV pools and the
attention backends read it, and it imports nothing of ferry's.

Counts (``num_kv_heads``) are the whole model's, as in its HF config; :meth:`LayerSpec.per_rank`
gives one tensor-parallel rank's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum


class AttentionKind(StrEnum):
    """How a layer's queries see the earlier tokens."""

    FULL = "full"          # causal attention over the whole sequence
    SLIDING = "sliding"    # causal attention over the last ``sliding_window`` tokens
    LATENT = "latent"      # multi-head latent attention (DeepSeek's MLA): K/V from a latent
    LINEAR = "linear"      # linear attention / a recurrence (Qwen3-Next's gated DeltaNet)
    NONE = "none"          # no token mixing (an MLP-only layer)


class CacheKind(StrEnum):
    """What a layer keeps per request between steps."""

    PAGED_KV = "paged_kv"              # K and V per token in the paged pool (engine/kv/pool.py)
    LATENT_KV = "latent_kv"            # one compressed latent (+ rope key) per token
    RECURRENT_STATE = "recurrent_state"  # a fixed-size state per request (conv + SSM state)
    NONE = "none"                      # nothing


@dataclass(frozen=True)
class RotarySpec:
    """The rotary position embedding of a layer.

    Attributes:
        kind: the rope type (``default``, ``linear``, ``llama3``; see
            ``engine.layers.rotary``).
        base: the frequency base (``rope_theta``).
        partial_factor: the fraction of ``head_dim`` that is rotated (1.0: all of it).
    """

    kind: str = "default"
    base: float = 10000.0
    partial_factor: float = 1.0


@dataclass(frozen=True)
class RecurrentStateSpec:
    """The per-request state of a linear-attention (Gated DeltaNet) layer: the whole model's
    in a model's specs, one rank's after :meth:`LayerSpec.per_rank`.

    Attributes:
        conv_dim: channels of the short causal conv (q|k|v: ``2*Hk*K + Hv*V``).
        conv_width: the conv's taps W (the state keeps the last W - 1 inputs).
        num_v_heads, k_head_dim, v_head_dim: the recurrent state is [Hv, K, V] (float32).
    """

    conv_dim: int
    conv_width: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int

    def per_rank(self, tp_size: int) -> RecurrentStateSpec:
        """One of ``tp_size`` ranks' state: the layer's heads are split over the ranks, so
        the conv channels and value heads divide by ``tp_size`` (the model refuses a head
        count that does not divide: ``engine.layers.gated_deltanet``)."""
        if tp_size == 1:
            return self
        return replace(self, conv_dim=self.conv_dim // tp_size,
                       num_v_heads=self.num_v_heads // tp_size)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's attention and cache.

    Attributes:
        attention: the :class:`AttentionKind`.
        cache: the :class:`CacheKind` of what the layer keeps between steps.
        head_dim: query/key head size (elements).
        v_head_dim: value head size (elements; equal to ``head_dim`` except in latent
            attention).
        num_kv_heads: K/V heads of the whole model (before a tensor-parallel split).
        sliding_window: tokens a query sees, itself included (``SLIDING`` only), else None.
        logit_softcap: ``c`` of ``c * tanh(s / c)`` on the attention scores, else None.
        sinks: the layer has learned per-head attention sinks (gpt-oss).
        scale: the softmax scale; None for ``head_dim ** -0.5``.
        rotary: the layer's rotary embedding; None for a layer without one.
        kv_lora_rank: width of the compressed K/V latent (``LATENT`` layers; else 0).
        qk_rope_head_dim: width of the rotary key part shared by the heads (``LATENT``
            layers; else 0). A ``LATENT_KV`` cache keeps ``kv_lora_rank + qk_rope_head_dim``
            values per token (:attr:`latent_dim`).
        state: the per-request state of a ``RECURRENT_STATE`` layer (its pool needs it),
            else None.
        kv_source_layer: the index of an earlier layer of the same shape whose paged K/V
            this layer reads instead of keeping its own (Gemma 4's KV sharing); the layer
            computes no K/V, writes none, and the pool gives it no memory (its
            ``k_buffers[i]`` is the source's, :func:`engine.kv.pool.build_kv_pool`).
            None: the layer keeps its own K/V.

    Raises:
        ValueError: an inconsistent description (a window on a non-sliding layer, a
            sliding layer without one, a non-positive size).
    """

    attention: AttentionKind = AttentionKind.FULL
    cache: CacheKind = CacheKind.PAGED_KV
    head_dim: int = 0
    v_head_dim: int = 0
    num_kv_heads: int = 0
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: bool = False
    scale: float | None = None
    rotary: RotarySpec | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    state: RecurrentStateSpec | None = None
    kv_source_layer: int | None = None

    def __post_init__(self):
        if self.kv_source_layer is not None and (self.kv_source_layer < 0
                                                 or self.cache != CacheKind.PAGED_KV):
            raise ValueError(f"kv_source_layer {self.kv_source_layer} on a {self.cache.value} "
                             "layer: a layer reads another's paged K/V only")
        if self.state is not None and self.cache != CacheKind.RECURRENT_STATE:
            raise ValueError(f"a {self.cache.value} cache with state={self.state}: the state "
                             "shape belongs to recurrent_state layers")
        if (self.attention == AttentionKind.SLIDING) != (self.sliding_window is not None):
            raise ValueError(f"a {self.attention.value} layer with sliding_window="
                             f"{self.sliding_window}: the window belongs to SLIDING layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} < 1")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap {self.logit_softcap} <= 0")
        if self.attention != AttentionKind.NONE and (
                self.head_dim < 1 or self.v_head_dim < 1 or self.num_kv_heads < 1):
            raise ValueError(f"a {self.attention.value} layer needs head_dim, v_head_dim and "
                             f"num_kv_heads >= 1 (got {self.head_dim}, {self.v_head_dim}, "
                             f"{self.num_kv_heads})")

    @property
    def latent_dim(self) -> int:
        """Values a ``LATENT_KV`` layer keeps per token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``scale``, else ``head_dim ** -0.5``."""
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    def per_rank(self, tp_size: int) -> LayerSpec:
        """This spec for one of ``tp_size`` tensor-parallel ranks (its K/V heads; see
        :func:`kv_heads_per_rank`; a ``RECURRENT_STATE`` layer's key heads and state, see
        :meth:`RecurrentStateSpec.per_rank`)."""
        if tp_size == 1 or self.num_kv_heads == 0 or self.cache == CacheKind.LATENT_KV:
            return self   # a latent cache is one shared head on every rank
        if self.state is not None:   # a linear layer's key heads and state, split
            return replace(self, num_kv_heads=self.num_kv_heads // tp_size,
                           state=self.state.per_rank(tp_size))
        return replace(self, num_kv_heads=kv_heads_per_rank(self.num_kv_heads, tp_size))

    def describe(self) -> str:
        """A short human description (``sliding-window attention (window 4096)``)."""
        what = {AttentionKind.FULL: "full attention",
                AttentionKind.SLIDING: f"sliding-window attention (window {self.sliding_window})",
                AttentionKind.LATENT: "latent attention (MLA)",
                AttentionKind.LINEAR: "linear attention",
                AttentionKind.NONE: "no attention"}[self.attention]
        extras = [f"logit soft-capping {self.logit_softcap}"] if self.logit_softcap else []
        extras += ["attention sinks"] if self.sinks else []
        return what + (f" with {', '.join(extras)}" if extras else "")


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """K/V heads one of ``tp_size`` ranks holds: ``num_kv_heads // tp_size``, at least one
    (heads are replicated when ``num_kv_heads < tp_size``)."""
    return max(num_kv_heads // tp_size, 1)


def cache_groups(specs: Sequence[LayerSpec]) -> dict[CacheKind, list[int]]:
    """The layer indices of each cache kind, in layer order (kinds in order of first use)."""
    groups: dict[CacheKind, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec.cache, []).append(i)
    return groups


def unsupported_feature(spec: LayerSpec, attention: frozenset[AttentionKind] | set,
                        *, sliding_window: bool = False, logit_softcap: bool = False,
                        sinks: bool = False) -> str | None:
    """What of ``spec`` an implementation that runs ``attention`` kinds (and the listed
    features) cannot run, as a phrase for an error message; None when it runs all of it."""
    if spec.attention not in attention:
        return spec.describe()
    if spec.sliding_window is not None and not sliding_window:
        return f"sliding-window attention (window {spec.sliding_window})"
    if spec.logit_softcap is not None and not logit_softcap:
        return f"logit soft-capping ({spec.logit_softcap})"
    if spec.sinks and not sinks:
        return "attention sinks"
    return None


__all__ = ["AttentionKind", "CacheKind", "LayerSpec", "RecurrentStateSpec", "RotarySpec",
           "cache_groups", "kv_heads_per_rank", "unsupported_feature"]
