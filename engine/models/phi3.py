"""Phi-3, Phi-3.5 and Phi-4 (``Phi3ForCausalLM``): the plain decoder with fused checkpoints.

- Checkpoints fuse q/k/v (``self_attn.qkv_proj``, rows ``[q | k | v]``) and gate/up
  (``mlp.gate_up_proj``, rows ``[gate | up]``); :func:`engine.models.weights.split_fused`
  hands the loaders each part under its unfused name, so tensor parallelism shards q, k, v,
  gate and up each over the ranks as for any other family.
- No biases; SwiGLU; RMSNorm.
- RoPE: ``longrope`` (Phi-3/3.5 128k: short factors below
  ``original_max_position_embeddings``, long from there on; see
  :mod:`engine.layers.rope_scaling`) or the default; ``partial_rotary_factor`` (Phi-4-mini:
  0.75) rotates the first part of each head.
- Every layer windowed when the config sets ``sliding_window`` (transformers' ``Phi3Model``
  masks every layer with it: Phi-3-mini-4k's 2047), else full attention (Phi-4).

LoRA adapters are refused at start-up (:attr:`Phi3ForCausalLM.lora_refusal`): PEFT adapters
of these checkpoints target the fused projections, which ferry's LoRA does not split.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.layer_spec import AttentionKind, LayerSpec
from engine.models.base import windowed_specs
from engine.models.blocks import AttentionOptions
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.weights import fused_names, split_fused


def fused_parts(mc: ModelConfig, qkv: bool = True) -> dict[str, list[tuple[str, int]]]:
    """The row split of the fused checkpoint projections (``qkv_proj`` only with ``qkv``)."""
    inter = mc.intermediate_size
    parts = {"gate_up_proj": [("gate_proj", inter), ("up_proj", inter)]}
    if qkv:
        parts["qkv_proj"] = [("q_proj", mc.q_size), ("k_proj", mc.kv_size),
                             ("v_proj", mc.kv_size)]
    return parts


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4: fused checkpoint projections, longrope, optional window."""

    family = "Phi-3"
    attention_kinds = (AttentionKind.FULL, AttentionKind.SLIDING)
    #: why LoRA is refused (engine/executor/preflight.py)
    lora_refusal = "LoRA adapters on its fused qkv_proj/gate_up_proj are not supported"

    def _options(self, config: ModelConfig) -> AttentionOptions:
        return AttentionOptions()

    def layer_specs(self) -> list[LayerSpec]:
        mc = self.model_config
        return windowed_specs(mc, [mc.sliding_window is not None] * mc.num_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """:meth:`DecoderForCausalLM.load_weights` of the checkpoint's tensors, the fused
        ``qkv_proj``/``gate_up_proj`` split into their parts (unfused ones load as they are).

        Raises:
            ValueError: a fused tensor of the wrong number of rows, or a part of the wrong
                shape.
        """
        return super().load_weights(split_fused(weights, fused_parts(self.model_config)))

    def hf_weight_names(self) -> list[str]:
        """The checkpoint's names: fused ``qkv_proj``/``gate_up_proj`` (what the Hub's
        safetensors and llama.cpp's ``attn_qkv``/``ffn_up`` hold)."""
        return fused_names(super().hf_weight_names(), fused_parts(self.model_config))

    def _hf_weight_shape(self, name: str, inter: int | None = None) -> tuple[int, ...]:
        return fused_shape(self, name, fused_parts(self.model_config), inter)


def fused_shape(model: DecoderForCausalLM, name: str, parts: dict, inter: int | None
                ) -> tuple[int, ...]:
    """The full shape of checkpoint tensor ``name`` of ``model``, fused ones included."""
    kind, leaf = name.split(".")[-2:]
    if kind not in parts:
        return DecoderForCausalLM._hf_weight_shape(model, name, inter)
    rows = sum(r for _, r in parts[kind])
    return (rows, model.model_config.hidden_size) if leaf == "weight" else (rows,)
