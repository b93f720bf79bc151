"""The model contract: what the executor requires of a model class.

Three callers use a model, and each needs only what is written here:

- ``ModelRunner`` (eager steps) and the decode ``GraphRunner`` (captures the whole decode
  step): :meth:`CausalLM.forward` ``(input_ids, positions, forward_batch) -> logits``. The
  forward must not sync with the host (it runs inside a captured graph), and attention goes
  through ``forward_batch.attn_backend`` (via :class:`engine.layers.attention.Attention`).
- ``PiecewiseRunner`` (prefill and mixed steps; captures everything but attention): the
  forward cut at its attention calls, :attr:`CausalLM.num_pieces` and
  :meth:`CausalLM.piece`, the attention modules that run between the pieces
  (:meth:`CausalLM.attention_layers`, whose ``q_size``/``kv_size`` size its buffers),
  ``model_config.hidden_size`` (the residual buffer) and :meth:`CausalLM.compute_logits`.
- The loader: construction as ``cls(hf_config, dtype)`` under ``with torch.device(dev):``,
  then :meth:`CausalLM.load_weights` with HF-named tensors, :meth:`CausalLM.expected_weights`
  to find what a checkpoint lacks, :meth:`CausalLM.hf_weight_names` to pick tensors out
  of a GGUF file, and :meth:`CausalLM.hf_weight_shapes` to draw dummy weights.

A model also exposes ``model_config`` (:class:`engine.models.config.ModelConfig`), which the
runner reads for the context and the vocabulary, and :meth:`CausalLM.layer_specs`, one
:class:`engine.layer_spec.LayerSpec` per layer (its attention kind, window, soft-cap, sinks,
scale, head sizes, cache kind, rotary), which the runner hands to the KV pool
(:func:`engine.kv.pool.build_kv_pool`: one store per cache kind) and to the attention
backend (which refuses a layer it cannot run), and each ``Attention`` layer holds. The
class attributes :attr:`CausalLM.family`, :attr:`CausalLM.attention_kinds` and
:attr:`CausalLM.cache_kinds` say the same per class, for ``docs/models.md``
(:mod:`engine.models.docs`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, RotarySpec
from engine.layers.logits import compute_logits

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch
    from engine.layers.attention import Attention
    from engine.models.config import ModelConfig


class CausalLM(nn.Module, ABC):
    """Base class of every registered model (``engine.models.MODEL_REGISTRY``).

    Subclasses set ``self.model_config`` in ``__init__(config, dtype)``.
    """

    model_config: ModelConfig
    #: the family's name in ``docs/models.md`` (several architectures may share one)
    family: ClassVar[str] = ""
    #: every attention kind and cache kind the class's layers may have (what
    #: :meth:`layer_specs` returns for any config is within these)
    attention_kinds: ClassVar[tuple[AttentionKind, ...]] = (AttentionKind.FULL,)
    cache_kinds: ClassVar[tuple[CacheKind, ...]] = (CacheKind.PAGED_KV,)
    #: hidden states kept by :meth:`forward` for a speculative draft head (None: none; see
    #: :meth:`set_capture_hidden`), and the last forward's, ``[T, width]`` (every new token)
    capture_hidden: str | None = None
    hidden_out: torch.Tensor | None = None

    # ---- the step ------------------------------------------------------------------------
    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """One step without host syncs.

        Args:
            input_ids: [T] int64 ids of the new tokens.
            positions: [T] int64 positions of those tokens in their sequences.
            forward_batch: the step (KV pool, attention backend, ``logits_indices``).
        Returns:
            float32 logits ``[len(logits_indices), vocab]`` (``[T, vocab]`` when
            ``logits_indices`` is None).
        """

    def set_capture_hidden(self, mode: str | None) -> None:
        """Keep hidden states of every forward in :attr:`hidden_out` for a draft head, from
        the same forward (EAGLE reads them; no second pass):

        - ``"last"``: the final normed hidden states ``[T, hidden]`` (EAGLE-1/2);
        - ``"aux"``: the unnormed inputs of three layers, low, mid and high, concatenated
          ``[T, 3 * hidden]`` (EAGLE-3);
        - None: nothing kept (the default).

        Only the eager forward keeps them (not a captured graph's replay).

        Raises:
            NotImplementedError: a model without the hook; ValueError: a bad mode.
        """
        raise NotImplementedError(f"{type(self).__name__} does not expose hidden states")

    # ---- the layers ----------------------------------------------------------------------
    def layer_specs(self) -> list[LayerSpec]:
        """One :class:`LayerSpec` per decoder layer, in order (whole-model head counts).

        The default: every layer full attention over the paged K/V cache, shaped by
        ``model_config`` (:func:`full_attention_specs`). A family with windowed, latent or
        linear layers overrides it (reading only ``self.model_config`` and ``self.config``:
        the decoder builds its layers from it).
        """
        return full_attention_specs(self.model_config)

    # ---- the piecewise split -------------------------------------------------------------
    @abstractmethod
    def attention_layers(self) -> list[Attention]:
        """The attention module of each layer, in forward order (L of them)."""

    @property
    def num_pieces(self) -> int:
        """Pieces of the forward between attention calls: one per layer, plus the tail."""
        return len(self.attention_layers()) + 1

    @abstractmethod
    def piece(self, i: int, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
              attn_out: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        """Piece ``i`` of the forward: everything between two attention calls.

        The forward is ``piece(0)``, ``attention_layers()[0]``, ``piece(1)``, ...,
        ``attention_layers()[L-1]``, ``piece(L)``. Every op in a piece must be row-wise
        (padding rows compute garbage that no real row reads) and sync-free.

        Args:
            i: 0 (reads ``input_ids`` [T] int64) .. L (reads ``attn_out`` [T, q_size] of
                layer i-1 and its ``residual`` [T, hidden]).
            positions: [T] int64.
        Returns:
            ``(q [T, q_size], k [T, kv_size], v [T, kv_size], residual [T, hidden])`` of
            layer i for i < L, q/k rotated; the final normed hidden states [T, hidden] for
            i == L.
        """

    @property
    def q_size(self) -> int:
        """Per-rank width of an attention input q row (Hq * D), from layer 0."""
        return self.attention_layers()[0].q_size

    @property
    def kv_size(self) -> int:
        """Per-rank width of a k or v row (Hkv * D), from layer 0."""
        return self.attention_layers()[0].kv_size

    # ---- the LM head ---------------------------------------------------------------------
    @property
    @abstractmethod
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden] LM head (the embedding table when tied); with tensor parallelism,
        this rank's rows of it."""

    def compute_logits(self, hidden: torch.Tensor,
                       logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Final hidden states [T, hidden] -> float32 logits of rows ``logits_indices``
        ([B] int64; None: all T rows)."""
        quant = getattr(self, "lm_head_quant", None)  # a GGUF head kept in its blocks
        if quant is not None:  # (tensor parallelism off: no gather)
            if logits_indices is not None:
                hidden = hidden.index_select(0, logits_indices)
            return quant(hidden).float()
        packed = getattr(self, "lm_head_packed", None)  # CPU: prepacked copy of a tied head
        return compute_logits(hidden, self.lm_head_weight if packed is None else packed,
                              logits_indices,
                              self.model_config.vocab_size)

    # ---- weights -------------------------------------------------------------------------
    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the keys loaded (see :meth:`expected_weights`).

        Raises:
            ValueError: a tensor of the wrong shape.
        """

    @abstractmethod
    def expected_weights(self) -> set[str]:
        """Keys a complete checkpoint fills (``name``, or ``name:shard`` for fused params)."""

    @abstractmethod
    def hf_weight_names(self) -> list[str]:
        """The HF checkpoint names of every weight the model needs."""

    @abstractmethod
    def hf_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full (unsplit by tensor parallelism) shape of each HF checkpoint tensor."""


def full_attention_specs(config: ModelConfig) -> list[LayerSpec]:
    """``config.num_layers`` specs of full attention over the paged K/V cache, with the
    config's head sizes, K/V heads and rotary (its ``rope_type`` and ``rope_theta``, the
    whole head rotated), the softmax scale ``head_dim ** -0.5``."""
    rotary = RotarySpec(kind=config.rope_parameters.get("rope_type", "default"),
                        base=config.rope_theta,
                        partial_factor=config.rope_parameters.get("partial_rotary_factor", 1.0))
    spec = LayerSpec(attention=AttentionKind.FULL, cache=CacheKind.PAGED_KV,
                     head_dim=config.head_dim, v_head_dim=config.head_dim,
                     num_kv_heads=config.num_kv_heads, rotary=rotary)
    return [spec] * config.num_layers


#: HF ``layer_types`` names -> attention kinds
LAYER_TYPES = {"full_attention": AttentionKind.FULL, "sliding_attention": AttentionKind.SLIDING}


def layer_type_specs(config: ModelConfig, layer_types, sliding_window: int | None,
                     rotary: list[bool] | None = None,
                     scale: float | None = None) -> list[LayerSpec]:
    """Specs from an HF config's ``layer_types`` (``"full_attention"`` or
    ``"sliding_attention"`` per layer; None: all full): the config's head sizes, K/V heads
    and rotary as :func:`full_attention_specs`, the window ``sliding_window`` (tokens) on the
    sliding layers, no rotary on layer ``i`` when ``rotary[i]`` is False (NoPE), the softmax
    ``scale`` (None: ``head_dim ** -0.5``).

    Raises:
        ValueError: an unknown layer type, a sliding layer without a window, or a list whose
            length is not ``config.num_layers``.
    """
    n = config.num_layers
    types = list(layer_types) if layer_types is not None else ["full_attention"] * n
    rotary = [True] * n if rotary is None else list(rotary)
    if len(types) != n or len(rotary) != n:
        raise ValueError(f"layer_types ({len(types)}) and rotary layers ({len(rotary)}) must "
                         f"list the {n} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"unknown layer types {unknown}; ferry runs {sorted(LAYER_TYPES)}")
    if "sliding_attention" in types and not sliding_window:
        raise ValueError("sliding_attention layers need the config's sliding_window")
    base = full_attention_specs(config)[0]
    specs = []
    for kind, rope in zip(types, rotary):
        attention = LAYER_TYPES[kind]
        specs.append(replace(base, attention=attention, scale=scale,
                             sliding_window=sliding_window
                             if attention == AttentionKind.SLIDING else None,
                             rotary=base.rotary if rope else None))
    return specs


def windowed_specs(config: ModelConfig, windowed: Sequence[bool]) -> list[LayerSpec]:
    """:func:`full_attention_specs`, with layer ``i`` sliding-window attention (window
    ``config.sliding_window``) where ``windowed[i]``.

    Raises:
        ValueError: a windowed layer while the config has no ``sliding_window``.
    """
    specs = full_attention_specs(config)
    if any(windowed) and not config.sliding_window:
        raise ValueError(f"{config.architecture}: windowed layers without a sliding_window")
    return [replace(s, attention=AttentionKind.SLIDING, sliding_window=config.sliding_window)
            if w else s for s, w in zip(specs, windowed, strict=True)]
