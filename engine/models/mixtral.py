"""Mixtral on :class:`engine.models.moe.MoeForCausalLM` (checked against transformers
5.24's ``modeling_mixtral.py``).

Mistral attention (q/k/v/o bias = ``attention_bias``); the MoE block is ``block_sparse_moe``
(router ``gate``, experts ``w1`` gate, ``w3`` up, ``w2`` down), its top-k weights always
renormalised; every layer is MoE. Layers are full attention over the paged KV cache: a
``sliding_window`` caps the context in the loader, as for Mistral (:mod:`engine.models.llama`).
"""

from __future__ import annotations

from engine.models.config import ModelConfig
from engine.models.moe import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Mistral attention, ``block_sparse_moe`` experts ``w1``/``w3``/``w2``, the
    top-k routing weights always renormalised."""

    family = "Mixtral"
    hf_moe_block = "block_sparse_moe"
    expert_parts = ("w1", "w3", "w2")

    def _renormalize(self, config: ModelConfig) -> bool:
        return True
