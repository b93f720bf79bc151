"""GLM-4.5 / 4.6 / 4.5-Air (``Glm4MoeForCausalLM``) served by ferry vs HF transformers.

Each case is a tiny random HF checkpoint (hidden 64, 4 query heads of 32 over 2 KV heads,
half of each head rotated, q/k/v bias, a dense first layer, 8 routed experts of width 32 in
4 groups, one shared expert, ``e_score_correction_bias`` drawn away from zero) loaded by the
offline ``LLM`` (float32, CPU): ``glm45`` has the q/k norms, groups (``topk_group`` 2),
``routed_scaling_factor`` 2.5 and renormalised weights; ``glm45_air`` is the Air's switches
(no q/k norm, one group, factor 1, not renormalised). Beside HF's tensors the checkpoint
holds a second file with an MTP layer's tensors (``model.layers.3.*``), which ferry skips.
ferry's greedy tokens must equal HF ``generate``'s and the chosen tokens' log-probabilities
agree within 1e-3 over 12 steps: in a batch of different lengths, alone (prefix cache
missed), with the prefix cache hit (whole and partial), prefilled in chunks of 16 tokens;
and TP=2 (gloo) gives TP=1's tokens and log-probabilities.
"""

from __future__ import annotations

import logging

import pytest
import torch
from moe_helpers import COMMON, save_random
from parity_helpers import (
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    assert_batch_and_alone_match_hf,
    assert_chunked_prefill_matches_hf,
    assert_prefix_hits_match_hf,
    case_fixtures,
    seeded_prompts,
)

from engine.layers.moe_grouped import GroupedMoeBlock
from engine.llm import LLM
from engine.models.blocks import GatedMLP
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

BASE = {**COMMON, "num_hidden_layers": 3, "head_dim": 32, "intermediate_size": 96,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "attention_bias": True,
        "partial_rotary_factor": 0.5}
SWITCHES = {
    "glm45": dict(use_qk_norm=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  norm_topk_prob=True),
    "glm45_air": dict(use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                      norm_topk_prob=False),
}
CASES = list(SWITCHES)
#: the MTP layer's tensors written beside the checkpoint (layer 3 of a 3-layer model)
MTP_NAMES = ("model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
             "model.layers.3.hnorm.weight", "model.layers.3.shared_head.norm.weight",
             "model.layers.3.mlp.experts.0.gate_proj.weight")


def save_tiny(case: str, path) -> torch.nn.Module:
    """Build, randomise (seeded) and save the HF model of ``case`` with an MTP layer's
    tensors in a second file; returns the HF model (eval)."""
    import transformers as T
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = T.Glm4MoeConfig(**BASE, **SWITCHES[case])
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    for name, buf in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.05 * torch.randn(buf.shape, generator=g))
    hf = save_random(hf, path)
    save_file({n: torch.ones(64, 64) if n.endswith("weight") and "norm" not in n
               else torch.ones(64) for n in MTP_NAMES}, str(path / "mtp.safetensors"))
    return hf


checkpoint, served = case_fixtures(CASES, save_tiny, seeded_prompts())


def test_layers_are_gqa_with_deepseek_moe(served):
    case, hf, llm, _ = served
    model = llm.runner.model
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    layers = model.model.layers
    assert isinstance(layers[0].mlp, GatedMLP)                       # first_k_dense_replace
    assert all(isinstance(layer.mlp, GroupedMoeBlock) for layer in layers[1:])
    assert layers[1].mlp.shared_experts is not None
    assert (layers[0].self_attn.q_norm is not None) == (case == "glm45")
    rope = model.model.rotary_emb
    assert rope.rotary_dim == 16 and not rope.interleaved
    routing = layers[1].mlp.gate.routing
    assert (routing.n_group, routing.scoring) == (SWITCHES[case]["n_group"], "sigmoid")


def test_batch_and_alone_match_hf(served):
    case, _, llm, ref = served
    assert_batch_and_alone_match_hf(llm, seeded_prompts(), ref, case)


def test_prefix_cache_hit_matches_hf(served):
    """The long prompt again (a hit), and one sharing its first 32 tokens (a partial hit)."""
    case, hf, llm, ref = served
    assert_prefix_hits_match_hf(llm, hf, seeded_prompts()[2], ref[2], case)


def test_chunked_prefill_matches_hf(checkpoint):
    """Prompts of 40 and 45 tokens prefilled 16 tokens a step, in a batch (mixed steps)."""
    case, hf, path, ref = checkpoint
    assert_chunked_prefill_matches_hf(path, hf, seeded_prompts()[2], ref[2], case)


def test_mtp_tensors_are_skipped_with_a_log_line(served, caplog):
    _, _, llm, _ = served
    model = llm.runner.model
    with caplog.at_level(logging.INFO, logger="engine.models.glm4_moe"):
        loaded = model.load_weights((n, torch.zeros(1)) for n in MTP_NAMES)
    assert loaded == set()
    assert "skipped 5 tensors of the multi-token-prediction layer (model.layers.3 and " \
           "after)" in caplog.text


def _run_tp(path, tp: int):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    with LLM(str(path), tp_size=tp, cpu_threads=1, dtype="float32", device="cpu",
             seed=3) as llm:
        first = llm.generate([PROMPT_A, PROMPT_C], sp)
        second = llm.generate([PROMPT_B], sp)
    assert second[0].num_cached_tokens >= 192
    outs = first + second
    return ([o.token_ids for o in outs],
            [lp for o in outs for tok_lp, top in o.logprobs
             for lp in [tok_lp, *(v for _, v in top)]])


def test_tp2_matches_tp1(checkpoint):
    """Heads, the dense MLP, every expert's and the shared experts' width split over two
    ranks (one all-reduce per MoE block); the routing replicated."""
    case, _, path, _ = checkpoint
    if case != "glm45":
        pytest.skip("one TP check for the family (the q/k-norm, grouped case)")
    ref_toks, ref_lps = _run_tp(path, 1)
    toks, lps = _run_tp(path, 2)
    assert toks == ref_toks
    worst = max(abs(a - b) for a, b in zip(lps, ref_lps))
    assert worst < 1e-4, f"largest log-prob difference TP=2 vs TP=1: {worst:.2e}"
