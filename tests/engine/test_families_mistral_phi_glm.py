"""The dense families of issue 42 (Mistral and Ministral with their windows, Phi-3 with its
fused checkpoint projections and longrope, GLM-4-0414) served by ferry vs HF transformers.

Each case is a tiny random HF checkpoint (``window_fused_helpers``: windows of 8 and 24 keys, shorter
than the long prompt) loaded by the offline ``LLM`` (float32, CPU). ferry's greedy tokens must
equal HF ``generate``'s and the chosen tokens' log-probabilities agree within 1e-3 over 12
steps: in a batch of different lengths, alone (prefix cache missed), with the prefix cache
hit, and with 16-token prefill chunks (chunk edges inside and across the windows). Phi-3 runs
TP=2 against TP=1 (gloo): its fused ``qkv_proj``/``gate_up_proj`` tensors split over the ranks.
"""

from __future__ import annotations

import pytest
import torch
from parity_helpers import (
    NEW_TOKENS,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    SP,
    assert_batch_and_alone_match_hf,
    assert_matches_hf,
    assert_prefix_hits_match_hf,
    hf_references,
    parity_llm,
    seeded_prompts,
)
from window_fused_helpers import DENSE_CASES, save_dense

from engine.llm import LLM
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def dense_checkpoints(tmp_path_factory):
    """case -> (checkpoint dir, HF model, HF reference per prompt); built once."""
    out = {}
    for case in DENSE_CASES:
        path = tmp_path_factory.mktemp(f"dense-{case}")
        hf = save_dense(case, path)
        out[case] = (str(path), hf, hf_references(hf, seeded_prompts()))
    return out


@pytest.fixture(scope="module", params=DENSE_CASES)
def served(request, dense_checkpoints):
    path, hf, ref = dense_checkpoints[request.param]
    with parity_llm(path) as llm:
        yield request.param, hf, llm, ref


def test_layers_describe_the_windows(served):
    case, hf, llm, _ = served
    specs = llm.runner.model.layer_specs()
    windows = [s.sliding_window for s in specs]
    expected = {"mistral": [8, 8], "ministral": [8, None, 8], "phi3": [24, 24],
                "glm4": [None, None]}[case]
    assert windows == expected
    assert llm.runner.model_config.context_length == 512     # no cap at the window


def test_batch_and_alone_match_hf(served):
    case, hf, llm, ref = served
    assert type(llm.runner.model).__name__ == type(hf).__name__
    assert_batch_and_alone_match_hf(llm, seeded_prompts(), ref, case)


def test_prefix_cache_hit_matches_hf(served):
    """The long prompt again (a hit past the window), and one sharing its first 32 tokens."""
    case, hf, llm, ref = served
    assert_prefix_hits_match_hf(llm, hf, seeded_prompts()[2], ref[2], case)


@pytest.mark.parametrize("case", DENSE_CASES)
def test_chunked_prefill_across_the_window_matches_hf(case, dense_checkpoints):
    """16-token prefill chunks: the 40-token prompt's later chunks attend to keys of earlier
    chunks, partly outside the window."""
    path, _, ref = dense_checkpoints[case]
    with parity_llm(path, chunked_prefill_size=16) as llm:
        outs = llm.generate(seeded_prompts(), SP)
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert_matches_hf(out, r, f"{case} prompt {i}, 16-token chunks")
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)


def _run_phi3_tp(path: str, tp: int):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    with LLM(path, tp_size=tp, cpu_threads=1, dtype="float32", device="cpu", seed=3) as llm:
        layer = llm.runner.model.model.layers[0]
        qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
        assert qkv.shape[0] == (4 + 2 * 2) * 16 // tp      # this rank's q, k and v heads
        assert gate_up.shape[0] == 2 * 96 // tp
        first = llm.generate([PROMPT_A, PROMPT_C], sp)
        second = llm.generate([PROMPT_B], sp)
    assert second[0].num_cached_tokens >= 192
    outs = first + second
    lps = [lp for o in outs for tok_lp, top in o.logprobs
           for lp in [tok_lp, *(v for _, v in top)]]
    return [o.token_ids for o in outs], lps


def test_phi3_tp2_matches_tp1(dense_checkpoints):
    """The fused checkpoint tensors split into q/k/v and gate/up shards per rank (lazy
    slices); a 300-token prompt (past the window and the longrope original context)."""
    path = dense_checkpoints["phi3"][0]
    ref_toks, ref_lps = _run_phi3_tp(path, 1)
    toks, lps = _run_phi3_tp(path, 2)
    assert toks == ref_toks
    assert len(lps) == len(ref_lps) > 0
    worst = max(abs(a - b) for a, b in zip(lps, ref_lps))
    assert worst < 1e-4, f"largest log-prob difference TP=2 vs TP=1: {worst:.2e}"


def test_phi3_refuses_lora(dense_checkpoints):
    path = dense_checkpoints["phi3"][0]
    with pytest.raises(ValueError, match="Phi3ForCausalLM: LoRA adapters on its fused"):
        LLM(path, dtype="float32", device="cpu", cpu_threads=1, enable_lora=True,
            max_lora_rank=8)


def test_fused_checkpoint_tensor_of_the_wrong_size_is_named(tmp_path):
    from engine.models.weights import split_fused

    parts = {"qkv_proj": [("q_proj", 4), ("k_proj", 2), ("v_proj", 2)]}
    name = "model.layers.0.self_attn.qkv_proj.weight"
    split = dict(split_fused([(name, torch.arange(16.).view(8, 2))], parts))
    assert split["model.layers.0.self_attn.k_proj.weight"].tolist() == [[8., 9.], [10., 11.]]
    with pytest.raises(ValueError, match=r"qkv_proj.weight: checkpoint tensor has 9 rows"):
        list(split_fused([(name, torch.zeros(9, 2))], parts))
