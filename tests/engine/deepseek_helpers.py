"""Tiny random DeepSeek-V2/V3 checkpoints (MLA and DeepSeek's MoE): HF models from small
configs (hidden 64, 4 heads, 8 routed experts in 4 groups, a dense first layer), every
weight drawn away from its init (:func:`moe_helpers.save_random`; V3's
``e_score_correction_bias`` too), saved with ``save_pretrained`` beside the character
tokenizer."""

from __future__ import annotations

import torch
from moe_helpers import COMMON, save_random

MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
       "head_dim": 8}
MOE = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
       "routed_scaling_factor": 2.0}


def config_of(case: str):
    import transformers as T

    base = {**COMMON, "num_key_value_heads": 4, "num_hidden_layers": 3,
            "intermediate_size": 96, **MLA, **MOE}
    if case == "v2":            # plain q_proj, softmax grouped routing
        return T.DeepseekV2Config(**base, q_lora_rank=None, topk_method="group_limited_greedy")
    if case == "v2_lora":       # low-rank q, greedy routing (no groups)
        return T.DeepseekV2Config(**base, q_lora_rank=24, topk_method="greedy")
    if case == "v3":            # low-rank q, sigmoid + bias, top-2 group scores, renormalised
        return T.DeepseekV3Config(**base, q_lora_rank=24, norm_topk_prob=True)
    if case == "v3_noq":        # plain q_proj, not renormalised, rope not interleaved
        return T.DeepseekV3Config(**base, q_lora_rank=None, norm_topk_prob=False,
                                  rope_interleave=False)
    raise KeyError(case)


CASES = ["v2", "v2_lora", "v3", "v3_noq"]


def save_tiny(case: str, path) -> torch.nn.Module:
    """Build, randomise (seeded) and save the HF model of ``case``; returns it (eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config_of(case), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    for name, buf in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.05 * torch.randn(buf.shape, generator=g))
    return save_random(hf, path)
