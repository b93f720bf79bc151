"""Llama, Mistral and Ministral: the plain decoder of :mod:`engine.models.decoder`.

Llama 2/3 (and SmolLM, and other Llama-shaped checkpoints), Mistral and Ministral: fused
QKV and gate-up projections, RMSNorm, RoPE (NeoX layout, any rope type of
``engine.layers.rotary``), SwiGLU; q/k/v/o bias = ``config.attention_bias`` (default
False).

Windows (HF semantics: a query sees the last ``sliding_window`` keys, itself included):

- Llama: every layer full attention.
- Mistral: every layer windowed when the config sets ``sliding_window`` (transformers'
  ``MistralModel`` masks every layer with it), else full attention.
- Ministral: per ``layer_types`` (``sliding_attention`` layers windowed, ``full_attention``
  layers not), as transformers' ``MinistralAttention``.

The windowed layers run on the ordinary paged KV pool (every key kept); the context is the
config's ``max_position_embeddings``, not capped at the window.
"""

from __future__ import annotations

from engine.layer_spec import AttentionKind, LayerSpec
from engine.models.base import windowed_specs
from engine.models.decoder import DecoderForCausalLM

_WINDOWED_KINDS = (AttentionKind.FULL, AttentionKind.SLIDING)


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3, SmolLM: q/k/v/o bias = ``attention_bias``, no q/k norm."""

    family = "Llama"


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral = Llama layers, every one windowed when ``sliding_window`` is set."""

    family = "Mistral"
    attention_kinds = _WINDOWED_KINDS

    def layer_specs(self) -> list[LayerSpec]:
        mc = self.model_config
        return windowed_specs(mc, [mc.sliding_window is not None] * mc.num_layers)


class MinistralForCausalLM(DecoderForCausalLM):
    """Ministral (8B): Mistral layers, windowed per ``layer_types``.

    Raises:
        ValueError: ``layer_types`` of the wrong length, or with an unknown type.
    """

    family = "Ministral"
    attention_kinds = _WINDOWED_KINDS

    def layer_specs(self) -> list[LayerSpec]:
        return windowed_specs(self.model_config, layer_type_windows(self.model_config))


def layer_type_windows(mc) -> list[bool]:
    """Whether each layer is windowed, from ``layer_types`` (unset: every layer when the
    config has a ``sliding_window``, as transformers defaults them).

    Raises:
        ValueError: ``layer_types`` of the wrong length, or with an unknown type.
    """
    types = mc.layer_types or (("sliding_attention" if mc.sliding_window else "full_attention",)
                               * mc.num_layers)
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if len(types) != mc.num_layers or unknown:
        raise ValueError(f"{mc.architecture}: layer_types must name sliding_attention or "
                         f"full_attention for each of the {mc.num_layers} layers, got "
                         f"{list(types)}")
    return [t == "sliding_attention" for t in types]
