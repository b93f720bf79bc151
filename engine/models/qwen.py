"""Qwen2 / Qwen2.5 and Qwen3 (dense): the decoder of :mod:`engine.models.decoder` with
Qwen's attention switches.

  - Qwen2: bias on q/k/v, none on o.
  - Qwen3: per-head RMSNorm on q and k (``q_norm``/``k_norm``) before RoPE; ``head_dim``
    from the config, which may differ from ``hidden_size / num_heads``; q/k/v/o bias =
    ``attention_bias``.

Every layer is full attention over the paged KV cache; a Qwen2 config's
``use_sliding_window`` caps the context in the loader, as Mistral's window does
(:mod:`engine.models.llama`).
"""

from __future__ import annotations

from engine.models.blocks import AttentionOptions
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5: bias on the q/k/v projections, none on o_proj."""

    family = "Qwen2"

    def _options(self, config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 (dense): per-head RMSNorm on q and k before RoPE; explicit ``head_dim``."""

    family = "Qwen3"

    def _options(self, config: ModelConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
