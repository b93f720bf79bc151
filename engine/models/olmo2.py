"""OLMo 2 and OLMo 3 on :mod:`engine.models.decoder` (checked against transformers 5.24's
``modeling_olmo2.py`` and ``modeling_olmo3.py``).

  - OLMo 2: post-norm layers (``post_attention_layernorm`` on the attention output and
    ``post_feedforward_layernorm`` on the MLP output, each before its residual add; no
    input norm), one RMSNorm over the whole q and the whole k projection (sizes
    ``num_heads * head_dim`` and ``num_kv_heads * head_dim``; under tensor parallelism the
    mean square is all-reduced, :class:`engine.layers.norm.ShardedRMSNorm`), q/k/v/o bias
    = ``attention_bias``. Every layer is full attention.
  - OLMo 3: OLMo 2's layers, with sliding-window attention on the layers ``layer_types``
    calls ``sliding_attention`` (``sliding_window`` tokens, the query's own included).
    Its ``rope_parameters`` are given per layer type; ferry builds one rotary table, so the
    two must agree (a config whose full layers alone are rescaled is refused).
"""

from __future__ import annotations

import copy

import torch

from engine.layer_spec import AttentionKind, LayerSpec
from engine.models.base import layer_type_specs
from engine.models.blocks import AttentionOptions, DecoderOptions
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM


class Olmo2ForCausalLM(DecoderForCausalLM):
    """OLMo 2: post-norm layers, RMSNorm over the whole q and k projections."""

    family = "OLMo 2"

    def _options(self, config: ModelConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm="full")

    def _decoder(self, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(norm_placement="post")


def _one_rope(config):
    """``config`` with one flat ``rope_parameters`` (OLMo 3 gives one per layer type).

    Raises:
        ValueError: the layer types' rope parameters differ.
    """
    params = getattr(config, "rope_parameters", None) or {}
    per_type = {k: v for k, v in params.items() if k in ("full_attention", "sliding_attention")}
    if not per_type:
        return config
    found = {k: dict(v or {}) for k, v in per_type.items()}
    first = next(iter(found.values()))
    if any(v != first for v in found.values()):
        raise ValueError(f"Olmo3ForCausalLM with different rope parameters per layer type "
                         f"({found}) is not supported; ferry builds one rotary table")
    flat = copy.copy(config)
    flat.rope_parameters = first
    return flat


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2 with sliding-window layers (``layer_types``, ``sliding_window``).

    Raises:
        ValueError: rope parameters that differ between the layer types.
    """

    family = "OLMo 3"
    attention_kinds = (AttentionKind.FULL, AttentionKind.SLIDING)

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__(_one_rope(config), dtype)

    def layer_specs(self) -> list[LayerSpec]:
        text = getattr(self.config, "text_config", None) or self.config
        return layer_type_specs(self.model_config, getattr(text, "layer_types", None),
                                getattr(text, "sliding_window", None))
