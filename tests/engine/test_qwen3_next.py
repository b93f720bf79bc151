"""Qwen3-Next, Qwen3.5, Qwen3.5-MoE and a multimodal Qwen3.5's language model (hybrid Gated
DeltaNet + gated full attention) served by ferry vs HF transformers, and the recurrent-state
pool's bookkeeping.

Each case is a tiny random HF checkpoint (``qwen3_next_helpers``: 4 layers, full attention
every 2nd or 4th) loaded by the offline ``LLM`` (float32, CPU). ferry's greedy tokens must
equal HF ``generate``'s over 12 steps and the chosen tokens' log-probabilities agree within
1e-3: in a batch of different lengths (the 70-token prompt crosses the gated delta rule's
64-token chunk), alone, across chunked-prefill boundaries (``chunked_prefill_size=16``: the
linear layers carry their state from chunk to chunk), with a request joining while others
decode (a mixed prefill + decode step), after an abort in the middle, with more requests
than state slots, and after recompute preemptions. After each run every state slot is free
again and the scheduler's accounting (pages and slots) held after every step.
"""

from __future__ import annotations

import pytest
from parity_helpers import (
    NEW_TOKENS,
    SP,
    assert_matches_hf,
    assert_tokens_match_hf,
    hf_greedy,
    hf_references,
    parity_llm,
    seeded_prompts,
)
from qwen3_next_helpers import CASES, save_tiny

from engine.layers.moe import SparseMoeBlock
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req

pytestmark = pytest.mark.slow



def _prompts() -> list[list[int]]:
    return seeded_prompts(high=250, lengths=(5, 13, 70, 24, 9))


def _slots_all_free(llm) -> None:
    pool = llm.runner.state_pool
    assert pool is not None
    assert pool.available() == pool.num_slots, "a state slot was not given back"
    assert all(r.state_slot is None for r in llm.scheduler.reqs.values())


@pytest.fixture(scope="session", params=CASES)
def checkpoint(request, tmp_path_factory):
    """(case, checkpoint dir, HF reference per prompt, HF model), built once per session."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    return request.param, str(path), hf_references(hf, _prompts()), hf


@pytest.fixture(scope="session")
def next_checkpoint(checkpoint):
    """The Qwen3-Next case only (the scheduler checks run on one family)."""
    if checkpoint[0] != "qwen3_next":
        pytest.skip("the state-slot bookkeeping is checked on the Qwen3-Next checkpoint")
    return checkpoint


def _llm(path: str, **kw) -> LLM:
    llm = parity_llm(path, **kw)
    llm.scheduler.check_kv = True   # pages and state slots accounted after every step
    return llm


def test_batch_and_alone_match_hf(checkpoint):
    case, path, ref, _ = checkpoint
    prompts = _prompts()[:3]
    with _llm(path) as llm:
        kinds = {s.cache.value for s in llm.runner.model.layer_specs()}
        assert kinds == {"paged_kv", "recurrent_state"}
        assert llm.runner.state_pool.num_slots == llm.args.max_running_requests
        assert llm.scheduler.kv.enabled and llm.runner.state_snapshots is not None
        blocks = [m for m in llm.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        # the MoE cases run with the shared gates folded into the routers (the default)
        assert bool(blocks) == (case in ("qwen3_next", "qwen3_5_moe"))
        assert all(b.router_gate_weight is not None for b in blocks)
        batch = llm.generate(prompts, SP)
        for i, (out, r) in enumerate(zip(batch, ref)):
            assert_matches_hf(out, r, f"{case} prompt {i} in a batch")
        for i, p in enumerate(prompts):
            alone = llm.generate([p], SP)[0]
            assert_matches_hf(alone, ref[i], f"{case} prompt {i} alone")
        _slots_all_free(llm)


def test_chunked_prefill_matches_hf(checkpoint):
    """Prefill chunks of 16 tokens: the 70-token prompt crosses four chunk boundaries (the
    linear layers continue from their slot's conv and recurrent states each time), in a
    batch whose other requests decode beside the chunks."""
    case, path, ref, _ = checkpoint
    if case == "qwen3_5_mm":
        pytest.skip("the same language model as qwen3_5")
    with _llm(path, chunked_prefill_size=16) as llm:
        outs = llm.generate(_prompts()[:3], SP)
        alone = llm.generate([_prompts()[2]], SP)[0]
        _slots_all_free(llm)
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert_matches_hf(out, r, f"{case} prompt {i} chunked in a batch")
    assert_matches_hf(alone, ref[2], f"{case} long prompt chunked")


def _req(rid: str, prompt: list[int]) -> Req:
    return Req(rid, list(prompt), SP, False, NEW_TOKENS)


def _run(llm, reqs) -> None:
    while any(not r.finished for r in reqs) or llm.scheduler.has_work():
        llm.scheduler.step()


def test_request_joins_while_others_decode(next_checkpoint):
    """Two requests decode; a third (the 70-token prompt, in chunks of 32) joins after three
    steps: its prefill chunks run in mixed steps beside their decodes."""
    case, path, ref, _ = next_checkpoint
    prompts = _prompts()
    with _llm(path, chunked_prefill_size=32) as llm:
        sched = llm.scheduler
        first = [_req("a", prompts[0]), _req("b", prompts[1])]
        for r in first:
            sched.add_request(r)
        for _ in range(3):
            sched.step()
        assert all(len(r.output_ids) >= 1 for r in first)   # decoding when the third joins
        late = _req("c", prompts[2])
        sched.add_request(late)
        _run(llm, first + [late])
        _slots_all_free(llm)
    for r, ref_i in zip(first + [late], ref[:3]):
        assert_tokens_match_hf(r.output_ids, r.logprobs, ref_i, f"{case} {r.rid} (joined late: c)")


def test_abort_mid_decode_frees_its_slot(next_checkpoint):
    case, path, ref, _ = next_checkpoint
    prompts = _prompts()
    with _llm(path) as llm:
        sched = llm.scheduler
        reqs = [_req(f"r{i}", p) for i, p in enumerate(prompts[:3])]
        for r in reqs:
            sched.add_request(r)
        for _ in range(4):
            sched.step()
        victim = reqs[1]
        assert victim.state_slot is not None and not victim.finished
        held = llm.runner.state_pool.available()
        sched.abort_request(victim.rid)
        sched.step()
        assert victim.finished_reason.type == "abort" and victim.state_slot is None
        assert llm.runner.state_pool.available() >= held + 1
        _run(llm, reqs)
        _slots_all_free(llm)
        # the freed slot is zeroed when the next request takes it: a fresh request is exact
        again = llm.generate([prompts[1]], SP)[0]
    for i in (0, 2):
        assert_tokens_match_hf(reqs[i].output_ids, reqs[i].logprobs, ref[i],
                               f"{case} r{i} beside abort")
    assert_matches_hf(again, ref[1], f"{case} after the abort")


def test_more_requests_than_slots_wait_and_finish(next_checkpoint):
    """Two state slots, five requests: admission waits for a slot (never fails), and each
    request that gets a recycled slot starts from the zero state."""
    case, path, ref, _ = next_checkpoint
    with _llm(path, max_running_requests=2) as llm:
        assert llm.runner.state_pool.num_slots == 2
        seen = []
        step = llm.scheduler.step

        def counted_step():
            seen.append(llm.runner.state_pool.available())
            return step()

        llm.scheduler.step = counted_step
        outs = llm.generate(_prompts(), SP)
        assert min(seen) == 0                      # every slot was held at some point
        _slots_all_free(llm)
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert_matches_hf(out, r, f"{case} prompt {i} of 5 on 2 slots")


def test_preemption_restarts_from_a_zeroed_state(next_checkpoint):
    """A KV pool too small for what three requests grow to: admission lets two in, whose
    decodes outgrow the pool, so the newest is preempted (recompute: its slot goes back,
    readmission takes a zeroed one, restored from a snapshot where the prefix cache kept
    one, and prefills the rest); every output is still HF's."""
    case, path, _, hf = next_checkpoint
    prompts = [_prompts()[i] for i in (2, 3, 1)]
    n = 30
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)
    with _llm(path, max_total_tokens=150, page_size=1) as llm:
        outs = llm.generate(prompts, sp)
        assert llm.scheduler.stats["preemptions"] > 0
        _slots_all_free(llm)
    for i, (out, p) in enumerate(zip(outs, prompts)):
        assert_matches_hf(out, hf_greedy(hf, p, n), f"{case} prompt {i} under preemption")


def test_start_up_line_and_bench_latency(next_checkpoint, caplog, capsys):
    """The start-up log names the state slots beside the KV tokens; ``bench_latency`` (which
    drives the runner without the scheduler) gives its requests state slots and back."""
    import logging

    from bench.bench_latency import main as bench_latency

    _, path, _, _ = next_checkpoint
    with caplog.at_level(logging.INFO, logger="engine.executor.rank_runner"):
        with _llm(path, max_running_requests=3) as llm:
            assert llm.runner.state_pool.num_slots == 3
    assert "recurrent state: 3 slots x 2 layers" in caplog.text
    assert "KV tokens for the 2 attention layers" in caplog.text
    bench_latency(["--model-path", path, "--device", "cpu", "--dtype", "float32",
                   "--cpu-threads", "1", "--batch-size", "1", "2", "--input-len", "8",
                   "--output-len", "4"])
    out = capsys.readouterr().out
    assert "bs=1 in=8 out=4" in out and "bs=2 in=8 out=4" in out


def test_abort_during_chunked_prefill_frees_its_slot(next_checkpoint):
    """The 70-token prompt in chunks of 16 is aborted while its prefill is half done (its
    slot holds a partial state); the request beside it is unaffected and every slot is
    free afterwards."""
    case, path, ref, _ = next_checkpoint
    prompts = _prompts()
    with _llm(path, chunked_prefill_size=16) as llm:
        sched = llm.scheduler
        short, long = _req("short", prompts[1]), _req("long", prompts[2])
        sched.add_request(short)
        sched.add_request(long)
        for _ in range(3):
            sched.step()
        assert sched.chunked is long and 0 < long.kv_len < len(prompts[2])
        sched.abort_request(long.rid)
        _run(llm, [short, long])
        assert long.finished_reason.type == "abort"
        _slots_all_free(llm)
    assert_tokens_match_hf(short.output_ids, short.logprobs, ref[1],
                           f"{case} beside a chunked abort")
