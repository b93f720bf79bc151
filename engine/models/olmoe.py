"""OLMoE on :class:`engine.models.moe.MoeForCausalLM` (checked against transformers 5.24's
``modeling_olmoe.py``).

One RMSNorm over the whole q and the whole k projection (sizes ``num_heads * head_dim`` and
``num_kv_heads * head_dim``; under tensor parallelism the mean square is all-reduced), no
q/k/v bias (``attention_bias``), ``norm_topk_prob`` from the config; ``clip_qkv`` is
refused. Every layer is full attention over the paged KV cache.
"""

from __future__ import annotations

import torch

from engine.models.blocks import AttentionOptions
from engine.models.config import ModelConfig
from engine.models.moe import MoeForCausalLM


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE: RMSNorm over the whole q and k projections, no bias by default.

    Raises:
        ValueError: a config with ``clip_qkv`` set.
    """

    family = "OLMoE"

    def __init__(self, config, dtype: torch.dtype = torch.float32):
        text = getattr(config, "text_config", None) or config
        clip = getattr(text, "clip_qkv", None)
        if clip is not None:
            raise ValueError(f"OlmoeForCausalLM with clip_qkv={clip} is not supported (ferry "
                             "does not clamp q/k/v); only clip_qkv null")
        super().__init__(config, dtype)

    def _options(self, config: ModelConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm="full")

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        mc = self.model_config
        if name.endswith(".self_attn.q_norm.weight"):
            return (mc.num_heads * mc.head_dim,)
        if name.endswith(".self_attn.k_norm.weight"):
            return (mc.num_kv_heads * mc.head_dim,)
        return super()._hf_weight_shape(name, inter)
