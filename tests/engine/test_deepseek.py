"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention over the latent pool, DeepSeek's
MoE) served by ferry vs HF transformers.

Each case is a tiny random HF checkpoint (:mod:`deepseek_helpers`: a dense first layer, 8
routed experts in 4 groups, a shared expert; q_lora on and off; V2's softmax routing with and
without groups, V3's sigmoid routing with the correction bias, rope interleaved and not)
loaded by the offline ``LLM`` (float32, CPU). ferry's greedy tokens must equal HF
``generate``'s and the chosen tokens' log-probabilities agree within 1e-3 over 12 steps: in
a batch of different lengths, alone (prefix cache missed), with the prefix cache hit (whole
and partial), and with prompts prefilled in chunks of 16 tokens.
"""

from __future__ import annotations

import pytest
from deepseek_helpers import CASES, save_tiny
from parity_helpers import (
    assert_batch_and_alone_match_hf,
    assert_chunked_prefill_matches_hf,
    assert_prefix_hits_match_hf,
    case_fixtures,
    seeded_prompts,
)

from engine.kv.pool import LatentKVPool
from engine.layer_spec import AttentionKind
from engine.layers.mla import MLAttention
from engine.layers.moe_grouped import GroupedMoeBlock
from engine.models.blocks import GatedMLP

pytestmark = pytest.mark.slow


checkpoint, served = case_fixtures(CASES, save_tiny, seeded_prompts())


def test_layers_are_mla_over_the_latent_pool(served):
    case, hf, llm, _ = served
    model = llm.runner.model
    assert type(model).__name__ == type(hf).__name__
    assert all(s.attention == AttentionKind.LATENT for s in model.layer_specs())
    assert isinstance(llm.runner.kv_pool, LatentKVPool)
    layers = model.model.layers
    assert all(isinstance(layer.self_attn, MLAttention) for layer in layers)
    assert isinstance(layers[0].mlp, GatedMLP)                       # first_k_dense_replace
    assert all(isinstance(layer.mlp, GroupedMoeBlock) for layer in layers[1:])
    assert (layers[0].self_attn.q_lora_rank is None) == (case in ("v2", "v3_noq"))


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
