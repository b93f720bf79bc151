"""The windowed KV pool (engine/kv/windowed.py) under the scheduler, with a fake model.

The fake runner of test_scheduler.py keeps a shadow of both pools: each step it writes every
new position's token id into its full slot and its windowed slot (through
``WindowedKVPool.translate``) and first checks that ``req_to_token`` maps every cached
position to its token, and the windowed table every position inside the window of the
step's first new token. Pages freed behind the window, reused by another request, the radix
match cut back, chunked prefill and preemption all show up as a mismatch; the page
accounting of both pools is checked after every step.
"""

import pytest
import torch
from test_scheduler import FakeRunner, assert_idle, expected, make_reqs, run_all

from engine.args import ServerArgs
from engine.kv.pool import ReqToTokenPool
from engine.kv.windowed import (
    PoolSplit,
    build_pools,
    split_tokens,
    usable_prefix_pages,
)
from engine.layer_spec import AttentionKind, LayerSpec
from engine.scheduler.scheduler import Scheduler

W = 10


def _specs(n_layers=6, every=6, window=W, heads=1, d=1):
    full = LayerSpec(head_dim=d, v_head_dim=d, num_kv_heads=heads)
    swa = LayerSpec(attention=AttentionKind.SLIDING, sliding_window=window, head_dim=d,
                    v_head_dim=d, num_kv_heads=heads)
    return [full if (i + 1) % every == 0 else swa for i in range(n_layers)]


class WindowedRunner(FakeRunner):
    """``FakeRunner`` with a windowed pool beside the full one (the shadow covers both)."""

    def __init__(self, full_tokens, swa_tokens, page_size=1, max_running=8, window=W):
        super().__init__(full_tokens, page_size, max_running)
        self.kv_pool, self.swa_pool = build_pools(
            _specs(window=window), PoolSplit(full_tokens, swa_tokens), page_size,
            torch.float32, "cpu")
        self.slot_token = torch.full((self.kv_pool.num_slots,), -1, dtype=torch.int64)
        self.swa_req_pool = ReqToTokenPool(max_running, self.max_context_len, "cpu")
        self.swa_token = torch.full((self.swa_pool.num_slots,), -1, dtype=torch.int64)
        self.peak_swa_pages = 0

    def forward(self, batch, future_ids=None):
        sw = self.swa_req_pool.req_to_token
        locs = self.swa_pool.translate(batch.out_cache_loc)
        off = 0
        for req, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            fill = req.fill_ids
            lo = max(0, p - self.swa_pool.window + 1)
            held = self.swa_token[sw[req.req_pool_idx, lo:p].long()].tolist()
            assert held == fill[lo:p], f"{req.rid}: windowed KV of the window is corrupt"
            for j in range(n):
                assert locs[off + j] >= self.swa_pool.page_size, "wrote into the sink page"
                sw[req.req_pool_idx, p + j] = locs[off + j]
                self.swa_token[locs[off + j]] = fill[p + j]
            off += n
            self.peak_swa_pages = max(self.peak_swa_pages, sum(1 for x in req.swa_pages if x))
        assert len(set(locs)) == len(locs), "windowed slot handed out twice"
        return super().forward(batch, future_ids)


def test_usable_prefix_pages_cuts_back_to_a_held_window():
    assert usable_prefix_pages([5, 6, 7], 4, 9) == 3          # all held
    assert usable_prefix_pages([0, 6, 7], 4, 9) == 3          # positions 4.. are enough
    assert usable_prefix_pages([0, 6, 7], 4, 10) == 0         # needs position 2: gone
    assert usable_prefix_pages([5, 0, 0, 8], 4, 4) == 4       # only page 3 is read
    assert usable_prefix_pages([5, 0, 0, 8], 4, 6) == 1       # cut back past the holes
    assert usable_prefix_pages([5, 0, 7, 8], 1, 2) == 4
    assert usable_prefix_pages([5, 0, 7, 8], 1, 3) == 4
    assert usable_prefix_pages([5, 0, 7, 8], 1, 4) == 1
    assert usable_prefix_pages([], 4, 8) == 0


def test_split_tokens_by_bytes_per_token():
    specs = _specs(6, every=6, heads=2, d=4)   # 5 windowed layers : 1 full
    s = split_tokens(specs, 6000, 0.2, torch.float32)
    # budget 6000 x 6 layer-units = F x 1 + 0.2 F x 5  ->  F = 18000, S = 3600
    assert (s.full_tokens, s.swa_tokens) == (18000, 3600)
    assert split_tokens(specs, 6000, 0.0, torch.float32) == PoolSplit(6000, 0)
    assert split_tokens(_specs(6, every=1), 6000, 0.2, torch.float32) == PoolSplit(6000, 0)
    assert split_tokens(specs, 6000, 0.001, torch.float32, 4000).swa_tokens == 4000
    # a budget the windowed layers' least size eats (a benchmark sized for one batch):
    # 600 x 6 units; S = min(4000, 720) = 720 -> F = 3600 - 3600 = 0 <= 600: one pool
    assert split_tokens(specs, 600, 0.2, torch.float32, 4000) == PoolSplit(600, 0)


def test_grow_frees_pages_behind_the_window():
    runner = WindowedRunner(512, 64, page_size=2)
    sched = Scheduler(ServerArgs(chunked_prefill_size=8, page_size=2,
                                 disable_radix_cache=True), runner)
    reqs = make_reqs([30], max_tokens=100)
    run_all(sched, reqs)
    assert reqs[0].output_ids == expected(reqs[0].origin_input_ids, 100)
    # 130 tokens; it never held more than the window plus a chunk of windowed pages
    assert runner.peak_swa_pages <= (W + 8) // 2 + 2
    assert runner.swa_pool.num_free_pages == runner.swa_pool.num_pages
    assert_idle(sched)


@pytest.mark.parametrize("page_size", [1, 2])
def test_swa_decode_reserve_covers_what_a_decode_takes(page_size):
    """``KVCacheManager.swa_decode_reserve`` (what admission and retraction keep free in the
    windowed pool for the running requests' next tokens) is never less than what a decode
    step takes from it, and nothing for requests past their window when a page falls
    behind as each takes one (page size 1: a request holds W + 1 slots however long it
    runs; the full pool's reserve, which the windowed pool used to keep too, is a slot
    each)."""
    runner = WindowedRunner(512, 64, page_size=page_size)
    sched = Scheduler(ServerArgs(chunked_prefill_size=8, page_size=page_size,
                                 disable_radix_cache=True), runner)
    sched.check_kv = True
    reqs = make_reqs([30, 5], max_tokens=40)
    for r in reqs:
        sched.add_request(r)
    pool, kv = runner.swa_pool, sched.kv
    reserves = []
    while sched.has_work():
        decoding = len(sched.running) == 2 and not sched.waiting and sched.chunked is None
        reserve, free = kv.swa_decode_reserve(sched.running), pool.num_free_pages
        sched.step()
        if decoding and not any(r.finished for r in reqs):
            assert free - pool.num_free_pages <= reserve // page_size
            reserves.append(reserve)
    assert reserves and max(reserves) > 0  # the short prompt's first tokens take pages
    if page_size == 1:  # both past their windows: each decode gives a slot back first
        assert reserves[-10:] == [0] * 10
    assert all(r.output_ids == expected(r.origin_input_ids, 40) for r in reqs)
    assert_idle(sched)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("full_tokens, swa_tokens", [(600, 48), (600, 400), (200, 64)])
def test_shared_prefixes_chunks_and_preemption(page_size, full_tokens, swa_tokens):
    """Prompts sharing prefixes of every length (hits cut back to a held window), chunked
    prefill across the window's edge, and pools small enough to preempt."""
    runner = WindowedRunner(full_tokens, swa_tokens, page_size=page_size)
    sched = Scheduler(ServerArgs(chunked_prefill_size=7, page_size=page_size,
                                 max_running_requests=8), runner)
    g = torch.Generator().manual_seed(page_size + swa_tokens)
    base = torch.randint(0, 1000, (60,), generator=g).tolist()
    reqs = make_reqs([5, 33, 12, 41, 3, 20], max_tokens=30)
    for i, r in enumerate(reqs):  # a shared head of varying length, then their own tail
        r.origin_input_ids = base[: 8 * i + 4] + r.origin_input_ids
    run_all(sched, reqs)
    # the next turn of a conversation: its last window is still held, a hit; the same
    # prompt again: its end fell behind the window (the match is cut back)
    again = make_reqs([5, 1], max_tokens=30, seed=9)
    r3 = reqs[3]
    again[0].origin_input_ids = r3.origin_input_ids + r3.output_ids + again[0].origin_input_ids
    again[1].origin_input_ids = list(r3.origin_input_ids)
    hits = sched.stats["prefix_cache_hits"]
    run_all(sched, again[:1])
    if swa_tokens == 400:  # (a small windowed pool may have evicted it)
        assert sched.stats["prefix_cache_hits"] - hits >= len(r3.origin_input_ids)
    run_all(sched, again[1:])
    for r in reqs + again:
        assert r.output_ids == expected(r.origin_input_ids, 30), r.rid
    assert_idle(sched)
    sched.kv.check([])


@pytest.mark.parametrize("page_size", [1, 4])
def test_preemption_frees_both_pools(page_size):
    runner = WindowedRunner(96, 200, page_size=page_size)
    sched = Scheduler(ServerArgs(chunked_prefill_size=32, max_running_requests=8,
                                 page_size=page_size), runner)
    reqs = make_reqs([20, 25, 10, 30, 15, 22], max_tokens=20, seed=1)
    run_all(sched, reqs)
    for r in reqs:
        assert r.output_ids == expected(r.origin_input_ids, 20)
    assert sched.stats["preemptions"] > 0
    assert_idle(sched)
