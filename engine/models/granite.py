"""Granite 3.x on :mod:`engine.models.decoder` (checked against transformers 5.24's
``modeling_granite.py``): Llama's layers with four multipliers from the config:

  - ``embedding_multiplier``: the token embeddings are scaled by it;
  - ``residual_multiplier``: the attention and MLP outputs are scaled by it before their
    residual adds (:class:`engine.models.blocks.ScaledResidualDecoderLayer`);
  - ``attention_multiplier``: the softmax scale (the layers' ``LayerSpec.scale``), in place
    of ``head_dim ** -0.5``;
  - ``logits_scaling``: the logits are divided by it.

q/k/v/o bias = ``attention_bias``, MLP bias = ``mlp_bias``. Every layer is full attention.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.layer_spec import LayerSpec
from engine.models.base import full_attention_specs
from engine.models.blocks import DecoderOptions
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM


def _multiplier(config, name: str) -> float:
    text = getattr(config, "text_config", None) or config
    value = getattr(text, name, None)
    return 1.0 if value is None else float(value)


class GraniteForCausalLM(DecoderForCausalLM):
    """Granite 3.x: Llama layers with embedding, residual, attention and logit multipliers."""

    family = "Granite"

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        #: the logits are divided by it
        self.logits_scaling = _multiplier(config, "logits_scaling")

    def _decoder(self, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(residual_multiplier=_multiplier(self.config, "residual_multiplier"),
                              embedding_multiplier=_multiplier(self.config,
                                                               "embedding_multiplier"))

    def layer_specs(self) -> list[LayerSpec]:
        text = getattr(self.config, "text_config", None) or self.config
        scale = getattr(text, "attention_multiplier", None)
        specs = full_attention_specs(self.model_config)
        return specs if scale is None else [replace(s, scale=float(scale)) for s in specs]

    def compute_logits(self, hidden: torch.Tensor,
                       logits_indices: torch.Tensor | None) -> torch.Tensor:
        """As :meth:`engine.models.base.CausalLM.compute_logits`, divided by
        ``logits_scaling``."""
        return super().compute_logits(hidden, logits_indices) / self.logits_scaling
