"""Prefix reuse for the hybrid models (Qwen3-Next, Qwen3.5): the radix cache's hits restore
the linear layers' states from a snapshot (``engine/kv/state_snapshots.py``) beside the full
layers' KV, and give HF's greedy tokens and log-probs (1e-3) and those of a run with the
cache off.

Each test serves a tiny random checkpoint (``qwen3_next_helpers``) with the scheduler's
accounting (pages, state slots, snapshots) checked after every step: a hit after a finished
request, a hit beside misses in one batch, a match that diverges inside a cached segment
(cut back to a snapshot), the branching point a miss leaves a snapshot at, multi-turn chat,
chunked prefill with hits, eviction of snapshots and pages under memory pressure, pages of
four tokens, and preemption (a preempted request's readmission restores its own snapshot).
"""

from __future__ import annotations

import pytest
from parity_helpers import SP, assert_matches_hf, hf_greedy, parity_llm, seeded_prompts
from qwen3_next_helpers import save_tiny

from engine.kv.manager import BRANCH_SNAPSHOT_MIN

pytestmark = pytest.mark.slow

LONG = seeded_prompts(seed=11, lengths=(70,), high=250)[0]


def _tail(seed: int, n: int) -> list[int]:
    return seeded_prompts(seed=seed, lengths=(n,), high=250)[0]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def tiny(request, tmp_path_factory):
    """(case, checkpoint dir, HF model, HF reference of ``LONG``)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    return request.param, str(path), hf, hf_greedy(hf, LONG)


def _llm(path: str, **kw):
    llm = parity_llm(path, **kw)
    llm.scheduler.check_kv = True   # pages, state slots and snapshots after every step
    return llm


def _same_as_no_cache(path: str, prompts, outs, what: str) -> None:
    """The outputs of a cache-disabled run of ``prompts`` equal ``outs`` (tokens, and
    log-probs within 1e-3)."""
    with _llm(path, disable_radix_cache=True) as plain:
        assert not plain.scheduler.kv.enabled and plain.runner.state_snapshots is None
        ref = plain.generate(prompts, SP)
    for i, (a, b) in enumerate(zip(outs, ref)):
        assert a.token_ids == b.token_ids, f"{what} {i}: cache on vs off"
        worst = max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs))
        assert worst < 1e-3, f"{what} {i}: log-probs cache on vs off differ by {worst:.2e}"


def test_hit_after_a_finished_request(tiny):
    """The long prompt runs and finishes; a prompt that extends it hits its 70 tokens (the
    snapshot at the prompt's end), one diverging inside the cached output is cut back to
    that snapshot, and a hit shares a batch with two misses."""
    case, path, hf, ref = tiny
    grown = LONG + _tail(1, 6)
    with _llm(path) as llm:
        first = llm.generate([LONG], SP)[0]
        assert first.num_cached_tokens == 0
        assert_matches_hf(first, ref, f"{case} first")
        diverged = LONG + first.token_ids[:5] + _tail(2, 4)
        misses = [_tail(3, 13), _tail(4, 40)]
        outs = llm.generate([grown, diverged] + misses, SP)
        assert outs[0].num_cached_tokens == 70
        assert outs[1].num_cached_tokens == 70     # 75 tokens of KV match, cut back to 70
        assert [o.num_cached_tokens for o in outs[2:]] == [0, 0]
        for o, p, what in zip(outs, [grown, diverged] + misses,
                              ["grown", "diverged", "miss a", "miss b"]):
            assert_matches_hf(o, hf_greedy(hf, p), f"{case} {what}")
        stats = llm.scheduler.stats
        assert stats["prefix_cache_hits"] == 140
    _same_as_no_cache(path, [grown, diverged], outs[:2], f"{case} hit")


def test_branching_point_leaves_a_snapshot(tiny):
    """A prompt sharing the first 40 tokens of a cached one misses (no snapshot there) but
    stops its prefill at the branching point, so the next prompt with that prefix hits 40."""
    case, path, hf, _ = tiny
    assert 40 >= BRANCH_SNAPSHOT_MIN
    a, b = LONG[:40] + _tail(5, 9), LONG[:40] + _tail(6, 11)
    with _llm(path) as llm:
        llm.generate([LONG], SP)
        out_a = llm.generate([a], SP)[0]
        assert out_a.num_cached_tokens == 0
        out_b = llm.generate([b], SP)[0]
        assert out_b.num_cached_tokens == 40
    assert_matches_hf(out_a, hf_greedy(hf, a), f"{case} branching miss")
    assert_matches_hf(out_b, hf_greedy(hf, b), f"{case} branching hit")


def test_multi_turn_chat_reuses_the_first_turn(tiny):
    """Turn 2 is turn 1's prompt, its answer and a new message: it hits everything turn 1
    computed (the snapshot taken when turn 1 finished)."""
    case, path, hf, _ = tiny
    turn1 = _tail(7, 30)
    with _llm(path) as llm:
        ans = llm.generate([turn1], SP)[0]
        turn2 = turn1 + ans.token_ids + _tail(8, 7)
        out = llm.generate([turn2], SP)[0]
    assert out.num_cached_tokens == len(turn1) + len(ans.token_ids) - 1
    assert_matches_hf(out, hf_greedy(hf, turn2), f"{case} turn 2")
    _same_as_no_cache(path, [turn2], [out], f"{case} turn 2")


def test_chunked_prefill_with_hits(tiny):
    """Chunks of 16: the long prompt leaves a snapshot at each chunk end; a prompt sharing
    its first 50 tokens hits 48 (the last chunk end before them), one extending it hits 70
    and prefills its 40 new tokens in chunks."""
    case, path, hf, ref = tiny
    part, grown = LONG[:50] + _tail(9, 5), LONG + _tail(10, 40)
    with _llm(path, chunked_prefill_size=16) as llm:
        assert_matches_hf(llm.generate([LONG], SP)[0], ref, f"{case} chunked first")
        outs = llm.generate([part, grown], SP)
    assert [o.num_cached_tokens for o in outs] == [48, 70]
    assert_matches_hf(outs[0], hf_greedy(hf, part), f"{case} chunked partial hit")
    assert_matches_hf(outs[1], hf_greedy(hf, grown), f"{case} chunked hit")


def test_eviction_frees_snapshots(tiny, caplog):
    """Two snapshot slots and a small KV pool: every new prompt evicts older snapshots (and
    pages, which free their snapshots); the accounting holds every step, the last prompt
    still hits, and every answer is HF's. The start-up log shows the snapshots."""
    import logging

    case, path, hf, _ = tiny
    prompts = [_tail(20 + i, 30) for i in range(4)]
    caplog.set_level(logging.INFO, logger="ferry.engine")
    with caplog.at_level(logging.INFO, logger="engine"), \
            _llm(path, max_state_snapshots=2, max_total_tokens=160, page_size=1) as llm:
        assert "state snapshots (prefix cache): 2 x " in caplog.text
        assert "prefix cache: on" in caplog.text and "of the 2 snapshots" in caplog.text
        snaps = llm.runner.state_snapshots
        assert snaps.num_snapshots == 2
        outs = [llm.generate([p], SP)[0] for p in prompts]
        tree = llm.scheduler.kv.tree
        assert tree.snapshot_count <= 2 and snaps.available() == 2 - tree.snapshot_count
        again = llm.generate([prompts[-1] + _tail(30, 3)], SP)[0]
        assert again.num_cached_tokens == 30
    for i, (o, p) in enumerate(zip(outs, prompts)):
        assert_matches_hf(o, hf_greedy(hf, p), f"{case} prompt {i} under eviction")
    assert_matches_hf(again, hf_greedy(hf, prompts[-1] + _tail(30, 3)), f"{case} late hit")


def test_pages_of_four_tokens(tiny):
    """Pages of 4: the 70-token prompt's prefill stops at its last page boundary (68), whose
    snapshot a longer prompt hits; chunks of 18 end on page boundaries."""
    case, path, hf, ref = tiny
    grown = LONG + _tail(11, 5)
    with _llm(path, page_size=4, chunked_prefill_size=18) as llm:
        assert_matches_hf(llm.generate([LONG], SP)[0], ref, f"{case} pages of 4")
        out = llm.generate([grown], SP)[0]
    assert out.num_cached_tokens == 68
    assert_matches_hf(out, hf_greedy(hf, grown), f"{case} pages of 4 hit")


def test_preempted_request_resumes_from_its_snapshot(tiny):
    """A KV pool too small for three growing requests: the newest is preempted, its pages
    and a snapshot at its ``kv_len`` go into the tree, and its readmission restores that
    snapshot instead of recomputing from zero; every output is HF's."""
    case, path, hf, _ = tiny
    prompts = [LONG, _tail(12, 24), _tail(13, 13)]
    sp = SP.__class__(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    with _llm(path, max_total_tokens=150, page_size=1, max_state_snapshots=8) as llm:
        snaps = llm.runner.state_snapshots
        restored = []
        restore = snaps.restore
        snaps.restore = lambda snap, slot: (restored.append(snap), restore(snap, slot))
        outs = llm.generate(prompts, sp)
        assert llm.scheduler.stats["preemptions"] > 0 and restored
    for i, (o, p) in enumerate(zip(outs, prompts)):
        assert_matches_hf(o, hf_greedy(hf, p, 30), f"{case} prompt {i} under preemption")
