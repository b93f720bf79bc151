"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): the vision tower of
:mod:`engine.models.qwen3_vision` before a Qwen3 language model (per-head q/k norms) with
interleaved multimodal RoPE (``mrope_interleaved``), and DeepStack: the tower's extra
embeddings of each image token are added to its hidden state after the first decoder
layers, one level per layer. Everything else (image embeddings kept across prefill chunks,
the prefix-cache key, M-RoPE positions and decode deltas, eager steps with images, checkpoint
names, tensor parallelism with the tower replicated) is :mod:`engine.models.qwen2_5_vl`'s.
"""

from __future__ import annotations

from engine.models.blocks import AttentionOptions
from engine.models.config import ModelConfig
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3_vision import Qwen3VisionTower


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3-VL (dense): module docstring."""

    family = "Qwen3-VL"
    vision_tower = Qwen3VisionTower
    mrope_interleaved = True

    def _options(self, config: ModelConfig) -> AttentionOptions:
        bias = config.attention_bias
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
