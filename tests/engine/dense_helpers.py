"""Tiny random dense checkpoints of the families of issue 42 (OLMo 2, OLMo 3, SmolLM3,
Granite, EXAONE 4): HF models built from small configs (hidden 64, 4 heads, 2 K/V heads),
every weight drawn away from its init (:func:`moe_helpers.save_random`), saved with
``save_pretrained`` beside the character tokenizer. The windowed families get a window of
8 tokens, smaller than the test prompts."""

from __future__ import annotations

import torch
from moe_helpers import COMMON, save_random

WINDOW = 8


def config_of(case: str):
    import transformers as T

    dense = {**COMMON, "intermediate_size": 96}
    four = {**dense, "num_hidden_layers": 4}
    if case == "olmo2":        # post-norms, q/k norm over the whole projections, biases
        return T.Olmo2Config(**dense, attention_bias=True)
    if case == "olmo3":        # layers 0-2 sliding (window 8), layer 3 full
        return T.Olmo3Config(**four, sliding_window=WINDOW)
    if case == "smollm3":      # layers 1 and 3 without rotary (NoPE)
        return T.SmolLM3Config(**four, no_rope_layer_interval=2)
    if case == "smollm3_window":  # NoPE layers 1 and 3 also sliding (window 8)
        return T.SmolLM3Config(**four, no_rope_layer_interval=2, use_sliding_window=True,
                               sliding_window=WINDOW)
    if case == "granite":      # the four multipliers, q/k/v/o and MLP biases, tied head
        return T.GraniteConfig(**{**dense, "tie_word_embeddings": True}, attention_bias=True,
                               mlp_bias=True, embedding_multiplier=3.0,
                               residual_multiplier=0.5, attention_multiplier=0.1,
                               logits_scaling=4.0)
    if case == "exaone4":      # layers 0-2 sliding with RoPE, layer 3 full without (NoPE)
        return T.Exaone4Config(**four, sliding_window=WINDOW, sliding_window_pattern=4)
    raise KeyError(case)


CASES = ["olmo2", "olmo3", "smollm3", "smollm3_window", "granite", "exaone4"]


def save_tiny(case: str, path) -> torch.nn.Module:
    """Build, randomise (seeded) and save the HF model of ``case``; returns it (eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config_of(case), dtype=torch.float32).eval()
    return save_random(hf, path)
