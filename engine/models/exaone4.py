"""EXAONE 4.0 on :mod:`engine.models.decoder` (checked against transformers 5.24's
``modeling_exaone4.py``).

Post-norm layers as OLMo 2's (``post_attention_layernorm``, ``post_feedforward_layernorm``,
no input norm), a per-head RMSNorm on q and on k before RoPE (as Qwen3), no q/k/v/o bias.
With a ``sliding_window`` (the hybrid models, e.g. 32B), the layers ``layer_types`` calls
``sliding_attention`` attend to that window with RoPE, and the full-attention layers have
no rotary embedding (NoPE); without one (e.g. 1.2B) every layer is full attention with
RoPE.
"""

from __future__ import annotations

from engine.layer_spec import AttentionKind, LayerSpec
from engine.models.base import layer_type_specs
from engine.models.blocks import AttentionOptions, DecoderOptions
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM


class Exaone4ForCausalLM(DecoderForCausalLM):
    """EXAONE 4.0: post-norm layers, per-head q/k norm; sliding layers with RoPE and NoPE
    global layers when the config has a window."""

    family = "EXAONE 4"
    attention_kinds = (AttentionKind.FULL, AttentionKind.SLIDING)

    def _options(self, config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=False, o_bias=False, qk_norm=True)

    def _decoder(self, config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(norm_placement="post")

    def layer_specs(self) -> list[LayerSpec]:
        text = getattr(self.config, "text_config", None) or self.config
        window = getattr(text, "sliding_window", None)
        n = self.model_config.num_layers
        types = getattr(text, "layer_types", None) if window else None
        types = types or ["full_attention"] * n
        rotary = [window is None or t == "sliding_attention" for t in types]
        return layer_type_specs(self.model_config, types, window, rotary=rotary)
