"""Tiny random checkpoints of the dense families of issue 42 (Mistral, Ministral, Phi-3,
GLM-4) for the parity tests: hidden 64, 4 query heads of 16, 2 K/V heads, windows (8, 24)
shorter than the long prompt, Phi-3 with longrope (original context 128 of 512: an
attention factor != 1) and a partial rotary, GLM-4 with its partial interleaved rotary and
q/k/v bias; weights drawn by :func:`moe_helpers.save_random` (norms and biases away from
their init)."""

from __future__ import annotations

import torch
from moe_helpers import COMMON, save_random

DENSE_CASES = ["mistral", "ministral", "phi3", "glm4"]


def _phi3_rope() -> dict:
    g = torch.Generator().manual_seed(5)
    rd = int(16 * 0.75)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": 128,
            "short_factor": (1 + torch.rand(rd // 2, generator=g)).tolist(),
            "long_factor": (1 + 8 * torch.rand(rd // 2, generator=g)).tolist()}


def dense_config_of(case: str):
    import transformers as T

    if case == "mistral":      # every layer windowed (8 keys)
        return T.MistralConfig(**COMMON, intermediate_size=96, sliding_window=8)
    if case == "ministral":    # layers 0 and 2 windowed, 1 full
        return T.MinistralConfig(**{**COMMON, "num_hidden_layers": 3}, intermediate_size=96,
                                 head_dim=16,
                                 sliding_window=8, layer_types=["sliding_attention",
                                                                "full_attention",
                                                                "sliding_attention"])
    if case == "phi3":         # fused qkv / gate_up, longrope, partial 0.75, window 24
        return T.Phi3Config(**COMMON, intermediate_size=96, sliding_window=24,
                            partial_rotary_factor=0.75, rope_parameters=_phi3_rope())
    if case == "glm4":         # post-norms, partial interleaved rope, q/k/v bias
        return T.Glm4Config(**COMMON, intermediate_size=96, head_dim=16, attention_bias=True)
    raise KeyError(case)


def save_dense(case: str, path) -> torch.nn.Module:
    """Build, randomise (seeded) and save the HF model of ``case``; returns it (eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(dense_config_of(case), dtype=torch.float32).eval()
    return save_random(hf, path)
