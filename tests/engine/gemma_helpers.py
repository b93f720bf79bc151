"""Tiny random Gemma checkpoints for the tests: Gemma 2, Gemma 3 (text), a multimodal
Gemma 3 (its language model; a one-layer vision tower that ferry skips), Gemma 4 (text:
global layers of another head size with K = V and one K/V head, the last three layers
sharing K/V, double-wide MLPs on them, per-layer input embeddings) and a multimodal Gemma 4
(vision tower skipped), hidden 64, windows of 8 tokens (smaller than the test prompts),
soft-caps small enough to bite, saved with ``save_pretrained`` beside the character-level
tokenizer of :mod:`moe_helpers`."""

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
    if case in GEMMA4_CASES:
        return gemma4_config(case)
    raise KeyError(case)


#: Gemma 4: layers 2 and 5 global (head size 32, one K/V head, k = v), layers 3-5 read the
#: K/V of layers 1 (sliding) and 2 (global); no query_pre_attn_scalar (scale 1)
GEMMA4 = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
          "num_hidden_layers": 6, "sliding_window": 8, "max_position_embeddings": 512,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
          "num_kv_shared_layers": 3, "use_double_wide_mlp": True,
          "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 256,
          "final_logit_softcapping": 3.0, "bos_token_id": 1, "eos_token_id": 2,
          "pad_token_id": 0,
          "rope_parameters": {
              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
              "full_attention": {"rope_type": "proportional", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.25}}}
GEMMA4_CASES = ("gemma4", "gemma4_mm", "gemma4_moe")


def gemma4_config(case: str):
    """``gemma4``: the text model above; ``gemma4_moe``: it with the MoE block;
    ``gemma4_mm``: a Gemma4ForConditionalGeneration
    whose language model has separate K and V, two KV-sharing layers and plain-width MLPs (a
    one-layer vision tower, no audio). (Without per-layer inputs, HF's prefill of a
    KV-sharing model fails in ``_maybe_slice_kv_shared_inputs``, transformers 5.24.)"""
    import transformers as T

    if case == "gemma4":
        return T.Gemma4TextConfig(**GEMMA4, attn_implementation="eager")
    if case == "gemma4_moe":       # 4 GeGLU experts (top 2) beside every dense MLP
        return T.Gemma4TextConfig(**GEMMA4, enable_moe_block=True, num_experts=4,
                                  top_k_experts=2, moe_intermediate_size=32,
                                  attn_implementation="eager")
    text = {**GEMMA4, "attention_k_eq_v": False, "num_kv_shared_layers": 2,
            "use_double_wide_mlp": False}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
              "patch_size": 4, "position_embedding_size": 64}
    return T.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                          attn_implementation="eager")


CASES = ["gemma2", "gemma3", "gemma3_mm", *GEMMA4_CASES]


def save_tiny(case: str, path) -> torch.nn.Module:
    """Build, randomise (seeded; norms drawn around 1, so every ``(1 + w)`` matters) and
    save the HF model of ``case``; returns it (eval)."""
    import transformers as T

    torch.manual_seed(0)
    cfg = config_of(case)
    cls = {"gemma3_mm": T.Gemma3ForConditionalGeneration,
           "gemma4_mm": T.Gemma4ForConditionalGeneration}.get(case) or \
        T.AutoModelForCausalLM.from_config(cfg).__class__
    hf = cls(cfg).to(torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():   # Gemma 4's per-layer output scale (a buffer: save_random skips it)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))
    return save_random(hf, path, scale=0.15)
