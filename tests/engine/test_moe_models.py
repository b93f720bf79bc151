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
import torch
from moe_helpers import CASES, config_of

from engine.layers.moe import FusedMoE
from engine.llm import LLM
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
LOGPROB_TOL = 1e-3


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    a, b, c = (torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 13, 40))
    return [a, b, c]


def _hf_generate(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, toks)]
    return toks, lps


def _chosen_logprobs(out) -> list[float]:
    return [entry[0] for entry in out.logprobs]


SP = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=CASES)
def served(request, tiny_moe_checkpoint):
    """(case, HF model, ferry LLM, HF reference per prompt, checkpoint dir)."""
    path, hf = tiny_moe_checkpoint(request.param)  # the session's (tests/conftest.py)
    ref = [_hf_generate(hf, p) for p in _prompts()]
    llm = LLM(str(path), dtype="float32", device="cpu", cpu_threads=1,
              max_total_tokens=4096)
    yield request.param, hf, llm, ref, path
    llm.shutdown()


def _assert_matches(out, ref, what: str) -> None:
    toks, lps = ref
    assert out.token_ids == toks, f"{what}: ferry {out.token_ids} != HF {toks}"
    worst = max(abs(a - b) for a, b in zip(_chosen_logprobs(out), lps))
    assert worst < LOGPROB_TOL, f"{what}: log-prob differs from HF by {worst:.2e}"


def test_batch_and_alone_match_hf(served):
    case, hf, llm, ref, _ = served
    assert type(llm.runner.model).__name__ == type(hf).__name__
    prompts = _prompts()
    batch = llm.generate(prompts, SP)
    for i, (out, r) in enumerate(zip(batch, ref)):
        _assert_matches(out, r, f"{case} prompt {i} in a batch")
    for i, p in enumerate(prompts):
        assert llm.scheduler.flush_cache()
        alone = llm.generate([p], SP)[0]
        assert alone.num_cached_tokens == 0          # a prefix-cache miss
        _assert_matches(alone, ref[i], f"{case} prompt {i} alone")
        assert alone.token_ids == batch[i].token_ids


def test_prefix_cache_hit_matches_hf(served):
    """The long prompt again (its KV cached: a hit), and a prompt that shares its first 32
    tokens (a partial hit); both must still give HF's tokens."""
    case, hf, llm, ref, _ = served
    long = _prompts()[2]
    assert llm.scheduler.flush_cache()
    assert llm.generate([long], SP)[0].num_cached_tokens == 0     # a miss fills the cache
    again = llm.generate([long], SP)[0]
    assert again.num_cached_tokens is not None and again.num_cached_tokens >= 32
    _assert_matches(again, ref[2], f"{case} cached prompt")
    shared = long[:32] + [9, 8, 7, 6, 5]
    out = llm.generate([shared], SP)[0]
    assert out.num_cached_tokens >= 24
    _assert_matches(out, _hf_generate(hf, shared), f"{case} shared prefix")


# ---- tensor parallelism (gloo, 2 ranks on the CPU) ------------------------------------------

PROMPT_A = [(7 * i + 3) % 250 + 3 for i in range(300)]  # > the CPU prefill chunk (256)
PROMPT_B = PROMPT_A[:200] + [5, 6, 7, 8, 9, 10]        # shares a 200-token prefix
PROMPT_C = [11, 12, 13]


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
