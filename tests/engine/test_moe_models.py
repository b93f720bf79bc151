"""MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) served by ferry vs HF transformers.

Each case is a tiny random HF model (E=8 experts, top-2, hidden 64; every parameter drawn
with a seeded 0.1 scale so that the routing and the next token are far from ties) saved
with ``save_pretrained`` (the Hub's per-expert safetensors layout) and loaded by the
offline ``LLM`` (float32, CPU). ferry's greedy tokens must equal HF ``generate``'s and the
chosen tokens' log-probabilities agree within 1e-3, for prompts in a batch, alone, and
with the prefix cache hit. Two cases put dense MLP layers between the MoE layers
(``mlp_only_layers``, ``decoder_sparse_step``). Tensor parallelism TP=2 vs TP=1 (gloo)
runs on the Qwen2-MoE checkpoint (shared expert: one all-reduce per MoE layer, lazy
safetensors slices) and on dummy OLMoE weights (the q/k norm over the split projection, the
k part replicated). Expert parallelism (``--tp-size 2 --ep-size 2``: each rank holds 4 of the
8 experts whole) runs against TP=1 on the Qwen2-MoE checkpoint (the shared expert stays
TP-split) and on dummy Mixtral weights.
"""

from __future__ import annotations

import json

import pytest
from moe_helpers import CASES, config_of
from parity_helpers import (
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    assert_batch_and_alone_match_hf,
    assert_prefix_hits_match_hf,
    hf_references,
    parity_llm,
    seeded_prompts,
)

from engine.layers.moe import FusedMoE, SparseMoeBlock
from engine.llm import LLM
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module", params=CASES)
def served(request, tiny_moe_checkpoint):
    """(case, HF model, ferry LLM, HF reference per prompt, checkpoint dir)."""
    path, hf = tiny_moe_checkpoint(request.param)  # the session's (tests/conftest.py)
    ref = hf_references(hf, seeded_prompts())
    with parity_llm(path) as llm:
        yield request.param, hf, llm, ref, path


def test_batch_and_alone_match_hf(served):
    case, hf, llm, ref, _ = served
    assert type(llm.runner.model).__name__ == type(hf).__name__
    gated = [m for m in llm.runner.model.modules()
             if isinstance(m, SparseMoeBlock) and m.shared_expert_gate is not None]
    # Qwen2-MoE's shared gates run folded into the routers (the default)
    assert bool(gated) == case.startswith("qwen2_moe")
    assert all(m.router_gate_weight is not None for m in gated)
    assert_batch_and_alone_match_hf(llm, seeded_prompts(), ref, case)


def test_prefix_cache_hit_matches_hf(served):
    """The long prompt again (its KV cached: a hit), and a prompt that shares its first 32
    tokens (a partial hit); both must still give HF's tokens."""
    case, hf, llm, ref, _ = served
    assert_prefix_hits_match_hf(llm, hf, seeded_prompts()[2], ref[2], case)


# ---- tensor parallelism (gloo, 2 ranks on the CPU) ------------------------------------------


def _run_tp(path: str, tp: int, ep: int = 1, **kw):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    with LLM(path, tp_size=tp, ep_size=ep, cpu_threads=1, dtype="float32", device="cpu",
             seed=3, **kw) as llm:
        experts = [m for m in llm.runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts
        for m in experts:   # rank 0 holds E/ep experts (whole under ep, I/tp of each under tp)
            assert m.w13_weight.shape[:2] == (m.num_experts // ep,
                                              2 * m.intermediate_size // (1 if ep > 1 else tp))
        first = llm.generate([PROMPT_A, PROMPT_C], sp)
        second = llm.generate([PROMPT_B], sp)
    assert second[0].num_cached_tokens >= 192
    outs = first + second
    lps = [lp for o in outs for tok_lp, top in o.logprobs
           for lp in [tok_lp, *(v for _, v in top)]]
    return [o.token_ids for o in outs], lps


def _assert_tp_matches(path: str, ep: int = 1, **kw) -> None:
    ref_toks, ref_lps = _run_tp(path, 1, **kw)
    toks, lps = _run_tp(path, 2, ep, **kw)
    assert toks == ref_toks
    assert len(lps) == len(ref_lps) > 0
    worst = max(abs(a - b) for a, b in zip(lps, ref_lps))
    assert worst < 1e-4, f"largest log-prob difference TP=2 (EP={ep}) vs TP=1: {worst:.2e}"


def test_tp2_matches_tp1_qwen2_moe_checkpoint(tiny_moe_checkpoint):
    path, _ = tiny_moe_checkpoint("qwen2_moe_step2")
    _assert_tp_matches(str(path))


def test_tp2_matches_tp1_olmoe_dummy(tmp_path):
    """Dummy weights; one KV head, replicated on both ranks (k_norm's columns too)."""
    cfg = config_of("olmoe").to_dict()
    cfg.pop("attn_implementation", None)
    cfg["num_key_value_heads"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _assert_tp_matches(str(tmp_path), load_format="dummy")


# ---- expert parallelism (--ep-size 2 with --tp-size 2, gloo) --------------------------------


def test_ep2_matches_tp1_qwen2_moe_checkpoint(tiny_moe_checkpoint):
    """Experts 0-3 on rank 0, 4-7 on rank 1 (lazy slices of the other rank's experts never
    read); the shared expert and attention stay tensor-parallel."""
    path, _ = tiny_moe_checkpoint("qwen2_moe_step2")
    _assert_tp_matches(str(path), ep=2)


def test_ep2_matches_tp1_mixtral_dummy(tmp_path):
    cfg = config_of("mixtral").to_dict()
    cfg.pop("attn_implementation", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _assert_tp_matches(str(tmp_path), ep=2, load_format="dummy")


def test_ep_start_up_errors(tmp_path):
    """Refused before any worker starts: --ep-size without a matching --tp-size, and a
    number of experts the ranks cannot share."""
    cfg = config_of("mixtral").to_dict()
    cfg.pop("attn_implementation", None)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 5}))
    with pytest.raises(ValueError, match="--ep-size 2 must be 1 or equal to --tp-size 1"):
        LLM(str(tmp_path), ep_size=2, device="cpu", load_format="dummy")
    with pytest.raises(ValueError, match="--ep-size 2 does not divide the model's 5 experts"):
        LLM(str(tmp_path), tp_size=2, ep_size=2, device="cpu", load_format="dummy",
            cpu_threads=1)
