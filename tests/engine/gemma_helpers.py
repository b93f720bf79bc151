"""Tiny random Gemma checkpoints for the tests: Gemma 2, Gemma 3 (text) and a multimodal
Gemma 3 (its language model; a one-layer vision tower that ferry skips), hidden 64, windows
of 8 tokens (smaller than the test prompts), soft-caps small enough to bite, saved with
``save_pretrained`` beside the character-level tokenizer of :mod:`moe_helpers`."""

from __future__ import annotations

import torch
from moe_helpers import save_random

COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 512, "sliding_window": 8, "query_pre_attn_scalar": 24,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
#: Gemma 3: layers 2 and 5 global (pattern 3), local base 100, global base 10k with
#: linear scaling (factor 2)
GEMMA3 = {"num_hidden_layers": 6, "sliding_window_pattern": 3, "rope_local_base_freq": 100.0,
          "rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def config_of(case: str):
    import transformers as T

    if case == "gemma2":           # alternating local/global, both soft-caps
        return T.Gemma2Config(**COMMON, num_hidden_layers=4, attn_logit_softcapping=4.0,
                              final_logit_softcapping=3.0, attn_implementation="eager",
                              tie_word_embeddings=True)
    if case == "gemma3":           # 5:1-style local/global, q/k norms, a rope per type
        return T.Gemma3TextConfig(**COMMON, **GEMMA3, attn_implementation="eager",
                                  tie_word_embeddings=False)
    if case == "gemma3_mm":        # the language model of a Gemma3ForConditionalGeneration
        vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
        return T.Gemma3Config(text_config={**COMMON, **GEMMA3}, vision_config=vision,
                              mm_tokens_per_image=4, image_token_index=255,
                              boi_token_index=253, eoi_token_index=254,
                              attn_implementation="eager")
    raise KeyError(case)


CASES = ["gemma2", "gemma3", "gemma3_mm"]


def save_tiny(case: str, path) -> torch.nn.Module:
    """Build, randomise (seeded; norms drawn around 1, so every ``(1 + w)`` matters) and
    save the HF model of ``case``; returns it (eval)."""
    import transformers as T

    torch.manual_seed(0)
    cfg = config_of(case)
    cls = T.Gemma3ForConditionalGeneration if case == "gemma3_mm" else \
        T.AutoModelForCausalLM.from_config(cfg).__class__
    hf = cls(cfg).to(torch.float32).eval()
    return save_random(hf, path, scale=0.15)
