"""Tiny random Qwen3-Next and Qwen3.5 checkpoints for the tests: hidden 64, 4 layers with both
token mixers (Gated DeltaNet and gated full attention), 2 key / 4 value heads of 8 in the
linear layers (grouped value heads), 4 query / 2 K/V heads of 16 with a partial rotary (0.25)
in the full ones; Qwen3-Next with 4 experts (top-2) and a gated shared expert, one dense
layer; Qwen3.5 dense; Qwen3.5-MoE; a multimodal Qwen3.5 (text prompts; a one-layer
vision tower that ferry loads: images are tests/engine/test_qwen_vl.py's). Saved with ``save_pretrained`` beside the
character-level tokenizer of :mod:`moe_helpers`, weights drawn so that every one matters."""

from __future__ import annotations

import torch
from moe_helpers import save_random

COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "num_hidden_layers": 4, "max_position_embeddings": 512,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
          "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
          "tie_word_embeddings": False, "attn_implementation": "eager"}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 48}
#: full attention every 2nd layer (Qwen3-Next case) and every 4th (Qwen3.5's default pattern)
EVERY_2ND = ["linear_attention", "full_attention"] * 2
EVERY_4TH = ["linear_attention"] * 3 + ["full_attention"]


def config_of(case: str):
    import transformers as T

    if case == "qwen3_next":       # MoE with a gated shared expert; layer 2 dense
        return T.Qwen3NextConfig(**COMMON, **MOE, layer_types=EVERY_2ND, mlp_only_layers=[2],
                                 norm_topk_prob=True)
    if case == "qwen3_5":          # dense, Qwen3.5's split GDN projections
        return T.Qwen3_5TextConfig(**COMMON, layer_types=EVERY_4TH)
    if case == "qwen3_5_moe":      # every layer MoE, top-k renormalised; no dense width
        common = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
        return T.Qwen3_5MoeTextConfig(**common, **MOE, layer_types=EVERY_2ND)
    if case == "qwen3_5_mm":       # the language model of a Qwen3_5ForConditionalGeneration
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                  "patch_size": 4, "out_hidden_size": 64, "num_position_embeddings": 64}
        text = {k: v for k, v in COMMON.items() if k != "attn_implementation"}
        return T.Qwen3_5Config(text_config={**text, "layer_types": EVERY_4TH},
                               vision_config=vision, image_token_id=250, video_token_id=251,
                               vision_start_token_id=252, vision_end_token_id=253,
                               attn_implementation="eager")
    raise KeyError(case)


CASES = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_mm"]


def save_tiny(case: str, path) -> torch.nn.Module:
    """Build, randomise (seeded; (1 + w) norms drawn around 1, so their weights matter) and
    save the HF model of ``case``; returns it (eval, float32)."""
    import transformers as T

    torch.manual_seed(0)
    cfg = config_of(case)
    if case == "qwen3_5_mm":
        hf = T.Qwen3_5ForConditionalGeneration(cfg).to(torch.float32).eval()
    else:
        hf = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return save_random(hf, path, scale=0.15)
