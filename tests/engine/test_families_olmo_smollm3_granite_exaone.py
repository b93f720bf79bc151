"""The dense families of issue 42 served by ferry vs HF transformers: OLMo 2 (post-norms,
q/k norm over the whole projections), OLMo 3 (plus sliding-window layers), SmolLM3 (NoPE
layers; with and without a window on them), Granite 3.x (embedding, residual, attention and
logit multipliers) and EXAONE 4 (post-norms, per-head q/k norm, sliding layers with RoPE and
NoPE global layers).

Each case is a tiny random HF checkpoint (:mod:`dense_helpers`; windows of 8 tokens,
shorter than the prompts) loaded by the offline ``LLM`` (float32, CPU). ferry's greedy
tokens must equal HF ``generate``'s and the chosen tokens' log-probabilities agree within
1e-3 over 12 steps: in a batch of different lengths, alone (prefix cache missed), with the
prefix cache hit (whole and partial), and with prompts prefilled in chunks of 16 tokens.
TP=2 vs TP=1 (gloo) runs on the Granite checkpoint and on dummy OLMo 3 weights (the q/k
norm over the split projections, windowed layers).
"""

from __future__ import annotations

import json

import pytest
import torch
from dense_helpers import CASES, WINDOW, config_of, save_tiny
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

from engine.layer_spec import AttentionKind
from engine.layers.rotary import NoRotary
from engine.llm import LLM
from engine.models.blocks import PostNormDecoderLayer, ScaledResidualDecoderLayer
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

#: what each case's layers must be (so that a parity pass is not one of plain layers):
#: (layer class, sliding layers, NoPE layers)
SHAPE = {
    "olmo2": (PostNormDecoderLayer, [], []),
    "olmo3": (PostNormDecoderLayer, [0, 1, 2], []),
    "smollm3": (None, [], [1, 3]),
    "smollm3_window": (None, [1, 3], [1, 3]),
    "granite": (ScaledResidualDecoderLayer, [], []),
    "exaone4": (PostNormDecoderLayer, [0, 1, 2], [3]),
}


checkpoint, served = case_fixtures(CASES, save_tiny, seeded_prompts())


def test_layers_are_the_family_s(served):
    case, hf, llm, _ = served
    model = llm.runner.model
    assert type(model).__name__ == type(hf).__name__
    cls, sliding, nope = SHAPE[case]
    specs = model.layer_specs()
    assert [i for i, s in enumerate(specs) if s.attention == AttentionKind.SLIDING] == sliding
    assert all(specs[i].sliding_window == WINDOW for i in sliding)
    assert [i for i, s in enumerate(specs) if s.rotary is None] == nope
    assert [i for i, r in enumerate(model.model.layer_ropes) if isinstance(r, NoRotary)] == nope
    if cls is not None:
        assert all(type(layer) is cls for layer in model.model.layers)


def test_batch_and_alone_match_hf(served):
    case, _, llm, ref = served
    assert_batch_and_alone_match_hf(llm, seeded_prompts(), ref, case)


def test_prefix_cache_hit_matches_hf(served):
    """The long prompt again (a hit), and one sharing its first 32 tokens (a partial hit)."""
    case, hf, llm, ref = served
    assert_prefix_hits_match_hf(llm, hf, seeded_prompts()[2], ref[2], case)


def test_chunked_prefill_matches_hf(checkpoint):
    """Prompts of 40 and 45 tokens prefilled 16 tokens a step (boundaries inside the
    windows), in a batch."""
    case, hf, path, ref = checkpoint
    assert_chunked_prefill_matches_hf(path, hf, seeded_prompts()[2], ref[2], case)


# ---- tensor parallelism (gloo, 2 ranks on the CPU) ------------------------------------------


def _run_tp(path: str, tp: int, **kw):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    with LLM(path, tp_size=tp, cpu_threads=1, dtype="float32", device="cpu", seed=3,
             **kw) as llm:
        first = llm.generate([PROMPT_A, PROMPT_C], sp)
        second = llm.generate([PROMPT_B], sp)
    assert second[0].num_cached_tokens >= 192
    outs = first + second
    lps = [lp for o in outs for tok_lp, top in o.logprobs
           for lp in [tok_lp, *(v for _, v in top)]]
    return [o.token_ids for o in outs], lps


def _assert_tp_matches(path: str, **kw) -> None:
    ref_toks, ref_lps = _run_tp(path, 1, **kw)
    toks, lps = _run_tp(path, 2, **kw)
    assert toks == ref_toks
    assert len(lps) == len(ref_lps) > 0
    worst = max(abs(a - b) for a, b in zip(lps, ref_lps))
    assert worst < 1e-4, f"largest log-prob difference TP=2 vs TP=1: {worst:.2e}"


def test_tp2_matches_tp1_granite_checkpoint(tmp_path):
    save_tiny("granite", tmp_path)
    _assert_tp_matches(str(tmp_path))


def test_tp2_matches_tp1_olmo3_dummy(tmp_path):
    """Dummy weights; one K/V head, replicated on both ranks (k_norm's columns too)."""
    cfg = config_of("olmo3").to_dict()
    cfg.pop("attn_implementation", None)
    cfg["num_key_value_heads"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _assert_tp_matches(str(tmp_path), load_format="dummy")


# ---- the forward cut at the attention calls (the piecewise graphs' pieces) ------------------


@pytest.mark.parametrize("case", ["olmo3", "smollm3", "granite", "exaone4"])
def test_pieces_match_the_forward(case, tmp_path):
    """Post-norm layers, NoPE layers, windows and multipliers through the pieces (called
    directly over the padded buffers, no graphs): a prefill of two prompts longer than the
    window, then one mixed with their decodes; logits equal to the plain forward's."""
    from engine.args import ServerArgs
    from engine.executor.model_runner import ModelRunner
    from engine.executor.piecewise_runner import PiecewiseRunner
    from engine.scheduler.request import Req
    from engine.scheduler.scheduler import Scheduler

    cfg = config_of(case).to_dict()
    cfg.pop("attn_implementation", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ServerArgs(model_path=str(tmp_path), load_format="dummy", device="cpu",
                      dtype="float32", max_total_tokens=2048, chunked_prefill_size=64)
    runner = ModelRunner(args)
    sched = Scheduler(args, runner)
    pw = PiecewiseRunner(runner, max_tokens=96, use_graphs=False)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)

    def step():
        batch = sched.get_next_batch()
        ref = runner.forward(batch)
        torch.testing.assert_close(pw.run(batch), ref, rtol=1e-4, atol=1e-4)
        return batch

    for rid, n in (("a", 20), ("b", 17)):
        sched.add_request(Req(rid, torch.randint(3, 256, (n,), generator=g).tolist(), sp))
    batch = step()
    sched.inflight = sched._launch(batch)   # as Scheduler.step: a and b now decode
    sched._drain()
    sched.add_request(Req("c", torch.randint(3, 256, (33,), generator=g).tolist(), sp))
    assert step().num_decodes == 2
