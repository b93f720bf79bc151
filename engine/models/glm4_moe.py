"""GLM-4.5, GLM-4.6 and GLM-4.5-Air (``Glm4MoeForCausalLM``; checked against transformers
5.24's ``modeling_glm4_moe.py``).

- Attention: ordinary GQA (``head_dim`` 128 in the released models) with q/k/v bias
  (``attention_bias``), none on o; per-head q/k RMSNorm before RoPE when ``use_qk_norm``
  (GLM-4.5 and 4.6; not the Air); RoPE on the first ``partial_rotary_factor`` (0.5) of each
  head in the rotate-half layout (not GLM-4-0414's interleaved pairs).
- MLP: dense for the first ``first_k_dense_replace`` layers, otherwise DeepSeek-V3's MoE
  (:mod:`engine.models.deepseek_moe`: sigmoid scores, ``e_score_correction_bias``, grouped
  top-k over ``n_group`` / ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``,
  ``n_shared_experts`` shared experts). Pre-norm layers (Llama's), no extra norms.
- The multi-token-prediction layer (``num_nextn_predict_layers``: checkpoint layers
  ``model.layers.{num_hidden_layers}...``, with ``eh_proj``, ``enorm``, ``hnorm`` and
  ``shared_head``) is not run: its tensors are skipped at load with one log line.

Tensor and expert parallelism as the other MoE families (:class:`engine.models.moe.MoeForCausalLM`:
heads split, experts split over their width or whole per rank, one all-reduce per block).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.models.blocks import AttentionOptions
from engine.models.config import ModelConfig
from engine.models.deepseek_moe import grouped_moe_mlp, grouped_moe_weight_shape, sigmoid_routing
from engine.models.moe import MoeForCausalLM

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(MoeForCausalLM):
    """GLM-4.5 / 4.6 / 4.5-Air: GQA with partial rotary and optional q/k norm, DeepSeek's
    routing and shared experts, the MTP layer skipped.

    Raises:
        ValueError: as :class:`MoeForCausalLM` (quantized weights other than block FP8, no
            experts, an activation other than SiLU).
    """

    family = "GLM-4.5"

    def _text(self):
        return getattr(self.config, "text_config", None) or self.config

    def _options(self, config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=False,
                                qk_norm=bool(getattr(self._text(), "use_qk_norm", False)))

    def _mlp(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        return grouped_moe_mlp(config, layer_id, dtype, sigmoid_routing(self._text()),
                               self._expert_options())

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        shape = grouped_moe_weight_shape(self.model_config, name, super()._hf_weight_shape)
        return shape if shape is not None else super()._hf_weight_shape(name, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """:meth:`MoeForCausalLM.load_weights`, the MTP layers' tensors (layer indices from
        ``num_hidden_layers`` on) skipped and counted in one log line.

        Raises:
            ValueError: a tensor of the wrong shape.
        """
        n_layers = self.model_config.num_layers
        skipped: list[str] = []

        def decoder_only():
            for name, tensor in weights:
                m = _LAYER.match(name)
                if m and int(m.group(1)) >= n_layers:
                    skipped.append(name)
                    continue
                yield name, tensor

        loaded = super().load_weights(decoder_only())
        if skipped:
            logger.info("skipped %d tensors of the multi-token-prediction layer "
                        "(model.layers.%d and after): ferry does not run MTP", len(skipped),
                        n_layers)
        return loaded


__all__ = ["Glm4MoeForCausalLM"]
