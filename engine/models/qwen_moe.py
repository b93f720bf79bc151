"""Qwen3-MoE and Qwen2-MoE (Qwen1.5-MoE) on :class:`engine.models.moe.MoeForCausalLM`.

Checked against transformers 5.24's ``modeling_{qwen3_moe,qwen2_moe}.py``:

  - Qwen3-MoE: per-head q/k RMSNorm (as Qwen3), ``norm_topk_prob`` from the config; dense
    layers where ``mlp_only_layers``/``decoder_sparse_step`` say.
  - Qwen2-MoE: q/k/v bias (``qkv_bias``), none on o; a shared expert
    (``mlp.shared_expert.{gate,up,down}_proj``, width ``shared_expert_intermediate_size``)
    scaled by ``sigmoid(mlp.shared_expert_gate(x))`` and added to the routed experts;
    ``norm_topk_prob`` from the config (False by default).

Every layer is full attention over the paged KV cache (a ``use_sliding_window`` config caps
the context in the loader).
"""

from __future__ import annotations

from engine.models.blocks import AttentionOptions
from engine.models.config import ModelConfig
from engine.models.moe import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms), MoE layers with optional dense ones."""

    family = "Qwen3-MoE"

    def _options(self, config: ModelConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE): q/k/v bias, a gated shared expert beside the routed ones."""

    family = "Qwen2-MoE"
    has_shared_expert = True

    def _options(self, config: ModelConfig) -> AttentionOptions:
        text = getattr(self.config, "text_config", None) or self.config
        return AttentionOptions(qkv_bias=bool(getattr(text, "qkv_bias", True)), o_bias=False)
