"""Tensor (and expert) parallelism of the two groups that split more than attention heads
(issue 45 item 6, issue 46): the hybrid Gated DeltaNet models (Qwen3-Next, Qwen3.5) and the
MLA models (DeepSeek-V2/V3), on the CPU with gloo.

Each case is a tiny random checkpoint (tests/engine/qwen3_next_helpers.py,
deepseek_helpers.py; built once per module) served by the offline ``LLM`` at TP=1 (in this
process) and TP=2 (a worker process): a batch of a prompt longer than the CPU prefill chunk
(so chunked), a short one and a middling one, 12 greedy steps each; then a second batch
whose requests take the state slots the first freed (a worker must zero its own copy) and
may hit the cached prefix; then a third whose requests extend finished ones (the next turn
of the long prompt's conversation, the middling prompt grown), which hit the prefix cache:
on the hybrid models through state snapshots, which every rank takes and restores in its
own pool as rank 0 decides. NGRAM speculation on Qwen3-Next at TP=2 gives TP=1's tokens
(the verify steps' state commits reach the worker). Tokens identical, every returned log-prob (top 5 per step)
within 1e-3, the same ``cached_tokens`` (> 0 on the third batch). On the hybrid models the
TP=2 run then repeats the third batch with the snapshot restores kept from the worker (its
tokens differ) and again as sent (they agree). EP=2 (experts whole per rank) is checked on
the DeepSeek-V3 case.

Cases: Qwen3-Next (MoE with a gated shared expert, a dense layer, fused ``in_proj_qkvz``),
Qwen3.5 (dense, split projections), DeepSeek-V3 (``q_lora_rank``, sigmoid routing over 4
groups, a dense first layer), DeepSeek-V2 (no ``q_lora_rank``, softmax grouped routing).
Plus, without processes: head counts TP cannot split are refused before any worker starts
(one line), and the real shapes' dummy-weight shapes are the same at TP=2 as at TP=1 (a
rank draws the full tensors and keeps its part) with each rank's recurrent state halved.
"""

from __future__ import annotations

import json
import os

import deepseek_helpers
import pytest
import qwen3_next_helpers
from parity_helpers import LOGPROB_TOL, PROMPT_A, PROMPT_B, PROMPT_C, parity_llm, seeded_prompts

import engine
from engine.sampling.params import SamplingParams

#: case -> (helper module, its case name)
CASES = {"qwen3_next": (qwen3_next_helpers, "qwen3_next"),
         "qwen3_5": (qwen3_next_helpers, "qwen3_5"),
         "deepseek_v3": (deepseek_helpers, "v3"),
         "deepseek_v2": (deepseek_helpers, "v2")}
#: the cases with linear-attention layers (prefix reuse through state snapshots)
HYBRID = ("qwen3_next", "qwen3_5")
SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
MIDDLE = seeded_prompts(lengths=(40,))[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(case)``: the case's tiny checkpoint folder (built on first use)."""
    paths: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in paths:
            helpers, name = CASES[case]
            path = tmp_path_factory.mktemp(case)
            helpers.save_tiny(name, path)
            paths[case] = str(path)
        return paths[case]

    return get


@pytest.fixture(scope="module")
def tp1(checkpoint):
    """``tp1(case)``: the TP=1 run of the case (computed once)."""
    runs: dict[str, tuple] = {}

    def get(case: str) -> tuple:
        if case not in runs:
            runs[case] = _run(checkpoint(case))
        return runs[case]

    return get


def _run(path: str, monkeypatch=None, **kw) -> tuple[list[list[int]], list[float], list]:
    """(each output's tokens, every returned log-prob in order, each output's cached
    tokens) of the three batches; with ``monkeypatch`` (a hybrid model at TP=2), then
    :func:`_check_restores_reach_workers` on the third."""
    with parity_llm(path, **kw) as llm:
        outs = llm.generate([PROMPT_A, PROMPT_C, MIDDLE], SP)
        outs += llm.generate([PROMPT_B, PROMPT_C], SP)
        grown = [PROMPT_A + list(outs[0].token_ids) + [21, 22, 23], MIDDLE + [4, 5]]
        hits = llm.generate(grown, SP)
        if monkeypatch is not None:
            _check_restores_reach_workers(llm, grown, hits, monkeypatch)
        outs += hits
    lps = [lp for o in outs for step in o.logprobs for lp in _values(step)]
    return [list(o.token_ids) for o in outs], lps, [o.num_cached_tokens for o in outs]


def _check_restores_reach_workers(llm, prompts, good, monkeypatch) -> None:
    """``prompts`` (prefix-cache hits) again with the snapshot restores dropped from rank
    0's step messages: the worker's linear layers start from a stale state, so the tokens
    differ from ``good``; then as sent: the tokens are ``good``'s."""
    from engine.executor import rank_runner
    from engine.kv.state_snapshots import RESTORE

    real = rank_runner.step_msg

    def without_restores(*args, **kw):
        msg = real(*args, **kw)
        msg.snap_copies = [c for c in msg.snap_copies if c[0] != RESTORE]
        return msg

    with monkeypatch.context() as m:
        m.setattr(rank_runner, "step_msg", without_restores)
        broken = llm.generate(prompts, SP)
    assert all(o.num_cached_tokens for o in broken)
    for b, g in zip(broken, good):
        assert b.token_ids != g.token_ids, "the worker's restores made no difference"
    again = llm.generate(prompts, SP)
    assert [o.token_ids for o in again] == [o.token_ids for o in good]


def _values(step) -> list[float]:
    if step is None:
        return []
    if isinstance(step, dict):
        return [float(v) for v in step.values()]
    if isinstance(step, (list, tuple)):
        return [f for item in step for f in _values(item)]
    return [float(step)]


def _assert_same(got, ref, what: str) -> None:
    (got_toks, got_lps, got_cached), (ref_toks, ref_lps, ref_cached) = got, ref
    assert got_cached == ref_cached, f"{what}: cached tokens differ from TP=1"
    assert all(got_cached[-2:]), f"{what}: the grown prompts missed the prefix cache"
    assert got_toks == ref_toks, f"{what}: tokens differ from TP=1"
    assert len(got_lps) == len(ref_lps) >= 5 * 12 * 5
    worst = max(abs(a - b) for a, b in zip(got_lps, ref_lps))
    assert worst < LOGPROB_TOL, f"{what}: log-prob differs from TP=1 by {worst:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(case, checkpoint, tp1, monkeypatch):
    _assert_same(_run(checkpoint(case), monkeypatch if case in HYBRID else None, tp_size=2),
                 tp1(case), f"{case} TP=2")


def test_ngram_on_a_hybrid_model_at_tp2(checkpoint, tp1):
    """NGRAM speculation on Qwen3-Next at TP=2: the worker runs rank 0's verify steps (n
    rows a request, each row's state into a scratch slot) and makes rank 0's commits, sent
    with the next step (without either its half of the heads drifts); the tokens are
    TP=1's without speculation."""
    with parity_llm(checkpoint("qwen3_next"), tp_size=2, speculative_algorithm="NGRAM",
                    speculative_num_draft_tokens=2) as llm:
        outs = llm.generate([PROMPT_A, PROMPT_C, MIDDLE], SP)
        assert llm.scheduler.stats["spec_verify_reqs"] > 0
    assert [list(o.token_ids) for o in outs] == tp1("qwen3_next")[0][:3]


def test_ep2_matches_tp1(checkpoint, tp1):
    """DeepSeek-V3's 8 routed experts, 4 whole ones per rank (the shared expert and MLA
    still TP-split)."""
    _assert_same(_run(checkpoint("deepseek_v3"), tp_size=2, ep_size=2), tp1("deepseek_v3"),
                 "deepseek_v3 EP=2")


@pytest.mark.parametrize("case,fields,message", [
    # 3 key heads (each with 2 value heads): the check names the key heads, which the value
    # heads are a multiple of
    ("qwen3_next", {"architectures": ["Qwen3NextForCausalLM"], "linear_num_key_heads": 3,
                    "linear_num_value_heads": 6},
     "--tp-size 2 does not divide the model's 3 linear-attention heads "
     "(linear_num_key_heads): each rank holds whole Gated DeltaNet heads"),
    ("deepseek_v3", {"architectures": ["DeepseekV3ForCausalLM"], "num_attention_heads": 3,
                     "num_key_value_heads": 3},
     "--tp-size 2 does not divide the model's 3 attention heads"),
])
def test_heads_tp_cannot_split_are_refused(case, fields, message, tmp_path):
    """Refused by ``LLM`` (the tensor-parallel start-up check, before any worker starts)
    in one line; a dummy-weight config is enough."""
    helpers, name = CASES[case]
    config = helpers.config_of(name).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
    with pytest.raises(ValueError) as e:
        parity_llm(tmp_path, load_format="dummy", tp_size=2)
    assert str(e.value) == message


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "deepseek-v2-lite"])
def test_real_shapes_split_at_tp2(name, monkeypatch):
    """engine/configs/ on ``meta`` as rank 1 of 2: the dummy-weight shapes (full tensors)
    are TP=1's, each parameter is at most the full tensor, and a linear layer's state per
    rank is half the model's (16 of 32 value heads, half the conv channels)."""
    from engine import distributed
    from engine.args import ServerArgs
    from engine.executor.preflight import build_meta_model
    from engine.layer_spec import CacheKind

    path = os.path.join(os.path.dirname(engine.__file__), "configs", f"{name}.json")
    args = ServerArgs(model_path=path, load_format="dummy")
    one = build_meta_model(args, "cpu")
    monkeypatch.setattr(distributed, "_TP", distributed.TPGroup(size=2, rank=1))
    two = build_meta_model(args, "cpu")
    assert two.hf_weight_shapes() == one.hf_weight_shapes()
    p1 = sum(p.numel() for p in one.parameters())
    p2 = sum(p.numel() for p in two.parameters())
    assert p2 < 0.7 * p1
    for s1, s2 in zip(one.layer_specs(), two.layer_specs()):
        assert s2 == s1                              # the specs are the whole model's
        mine = s2.per_rank(2)
        if s1.cache == CacheKind.RECURRENT_STATE:
            assert mine.state.num_v_heads * 2 == s1.state.num_v_heads
            assert mine.state.conv_dim * 2 == s1.state.conv_dim
            assert mine.num_kv_heads * 2 == s1.num_kv_heads
        elif s1.cache == CacheKind.LATENT_KV:
            assert mine == s1                        # one latent row per token on each rank
    assert two.q_size * 2 == one.q_size
