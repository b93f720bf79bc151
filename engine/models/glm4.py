"""GLM-4 (0414: GLM-4-9B/32B-0414, ``Glm4ForCausalLM``).

- Attention: q/k/v bias = ``attention_bias`` (True in the released configs), none on o;
  RoPE on the first ``partial_rotary_factor`` (0.5) of each head in GLM's interleaved layout
  (pairs ``(0, 1), (2, 3)...``; ``engine.layers.rotary``).
- Two extra norms per layer: ``post_self_attn_layernorm`` on the attention output and
  ``post_mlp_layernorm`` on the MLP output, each before its residual add
  (:class:`Glm4DecoderLayer`).
- The checkpoint's MLP fuses gate/up (``mlp.gate_up_proj``, rows ``[gate | up]``), split at
  load (:func:`engine.models.weights.split_fused`).

LoRA adapters are refused at start-up, as for Phi-3 (fused ``gate_up_proj``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.models.blocks import AttentionOptions, DecoderLayer
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.phi3 import fused_parts, fused_shape
from engine.models.weights import fused_names, split_fused


class Glm4DecoderLayer(DecoderLayer):
    """GLM-4's layer: ``h += post_attn_norm(attn(norm(h)))``, ``h += post_mlp_norm(mlp(
    norm(h)))`` (the residual adds fused into the next layer's input norm as in
    :class:`DecoderLayer`)."""

    def __init__(self, config: ModelConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        dtype = self.input_layernorm.weight.dtype
        norm = type(self.input_layernorm)
        self.post_self_attn_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_mlp_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)

    def post_attn(self, attn_out: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """o projection and its norm, post-attention norm with the residual add, the MLP
        and its norm."""
        out = self.post_self_attn_layernorm(self.self_attn.o_proj(attn_out))
        hidden, residual = self.post_attention_layernorm(out, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(DecoderForCausalLM):
    """GLM-4-0414: extra post-norms, partial interleaved RoPE, q/k/v bias."""

    family = "GLM-4"
    decoder_layer = Glm4DecoderLayer
    #: why LoRA is refused (engine/executor/preflight.py)
    lora_refusal = "LoRA adapters on its fused gate_up_proj are not supported"

    def _options(self, config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=False,
                                rope_interleaved=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """:meth:`DecoderForCausalLM.load_weights`, the fused ``gate_up_proj`` split.

        Raises:
            ValueError: a tensor of the wrong shape.
        """
        parts = fused_parts(self.model_config, qkv=False)
        return super().load_weights(split_fused(weights, parts))

    def hf_weight_names(self) -> list[str]:
        """The checkpoint's names: fused ``gate_up_proj``."""
        return fused_names(super().hf_weight_names(), fused_parts(self.model_config, qkv=False))

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        return fused_shape(self, name, fused_parts(self.model_config, qkv=False), inter)
