"""The radix prefix cache: the tree against a brute-force model, and the scheduler with the
cache on, driven by the shadow-KV fake model of test_scheduler (which checks, every step,
that ``req_to_token`` maps each cached position of each request to a slot that holds that
request's token: a wrong shared page shows up there)."""

import random

import pytest
import torch
from test_scheduler import FakeRunner, assert_idle, expected, run_all

from engine.args import ServerArgs
from engine.kv.pool import KVPool
from engine.kv.radix_cache import RadixCache
from engine.sampling.params import SamplingParams
from engine.scheduler.prefix_policy import IN_BATCH_PREFIX
from engine.scheduler.request import Req
from engine.scheduler.scheduler import Scheduler


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_matches_a_brute_force_model(page_size):
    """Insert random sequences over a 3-letter alphabet (so they share prefixes at every
    depth); every match must return the pages that the first insertion of each page-aligned
    prefix gave the tree, and as many of them as the longest common prefix allows."""
    rng = random.Random(page_size)
    pool = KVPool(100_000, page_size, 1, 1, 1, torch.float32, "cpu")
    tree = RadixCache(pool)
    owner: dict[tuple, int] = {}  # page-aligned prefix -> the page the tree keeps for it
    inserted: list[list[int]] = []
    for _ in range(300):
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.5 and inserted:  # a continuation of an earlier one
            seq = rng.choice(inserted)[: rng.randrange(40)] + seq
        n_pages = len(seq) // page_size
        pages = pool.alloc_pages(n_pages)
        n_old, _ = tree.insert(seq, pages)
        for i in range(n_pages):
            key = tuple(seq[: (i + 1) * page_size])
            assert (key in owner) == (i < n_old)
            owner.setdefault(key, pages[i])
        pool.free_pages(pages[:n_old])  # duplicates of what the tree already had
        inserted.append(seq)
        query = [rng.randrange(3) for _ in range(rng.randrange(0, 45))]
        got, _ = tree.match_prefix(query)
        want = []
        while tuple(query[: (len(want) + 1) * page_size]) in owner \
                and (len(want) + 1) * page_size <= len(query):
            want.append(owner[tuple(query[: (len(want) + 1) * page_size])])
        assert got == want
    assert tree.total_pages == len(owner) == pool.used_tokens() // page_size
    assert tree.evictable_pages == len(owner)  # nothing locked


def test_lock_protects_and_eviction_frees_lru_leaves_first():
    pool = KVPool(64, 1, 1, 1, 1, torch.float32, "cpu")
    tree = RadixCache(pool)
    a, b = [1, 2, 3, 4], [1, 2, 9, 9, 9]
    tree.insert(a, pool.alloc_pages(4))
    tree.insert(b, pool.alloc_pages(5))  # shares [1, 2]: its first two pages are duplicates
    pages_b, node_b = tree.match_prefix(b)
    assert len(pages_b) == 5 and tree.total_pages == 7
    tree.lock(node_b)
    assert tree.protected_pages == 5 and tree.evictable_pages == 2
    assert tree.evict(100) == 2  # only a's own tail [3, 4] is unlocked
    assert tree.match_prefix(a)[0] == pages_b[:2]
    assert not tree.flush()  # refused while b is locked
    tree.unlock(node_b)
    tree.match_prefix(a)  # touch: the [1, 2] node is now the most recently used
    assert tree.flush() and tree.total_pages == 0


def _shared_prefix_reqs(groups, per_group, prefix_len, q_len, max_tokens, seed=0):
    rng = random.Random(seed)
    reqs = []
    for g in range(groups):
        head = [rng.randrange(1000) for _ in range(prefix_len)]
        for j in range(per_group):
            tail = [rng.randrange(1000) for _ in range(q_len)]
            reqs.append(Req(f"g{g}-{j}", head + tail, SamplingParams(max_tokens=max_tokens)))
    return reqs


@pytest.mark.parametrize("page_size", [1, 4])
def test_sequential_shared_prefix_hits_exactly_the_shared_pages(page_size):
    """One request at a time: every request after the first of its group finds the group's
    prefix (rounded down to whole pages) and computes only the rest."""
    runner = FakeRunner(max_total_tokens=4096, page_size=page_size)
    sched = Scheduler(ServerArgs(chunked_prefill_size=64, page_size=page_size), runner)
    reqs = _shared_prefix_reqs(3, 3, prefix_len=50, q_len=7, max_tokens=5)
    for r in reqs:
        run_all(sched, [r])
        assert r.output_ids == expected(r.origin_input_ids, 5)
    hits = [r.cached_tokens for r in reqs]
    shared = 50 // page_size * page_size
    assert hits == [0, shared, shared] * 3
    assert sched.stats["prefix_cache_hits"] == sum(hits)
    assert sched.stats["prefix_cache_queries"] == sum(len(r.origin_input_ids) for r in reqs)
    # the same prompt again: all of it but its last token (whose logits are sampled) hits
    again = Req("again", list(reqs[0].origin_input_ids), SamplingParams(max_tokens=5))
    run_all(sched, [again])
    assert again.output_ids == reqs[0].output_ids
    assert again.cached_tokens == (len(again.origin_input_ids) - 1) // page_size * page_size
    assert assert_idle(sched)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_request_hits_the_chunks_of_a_prefill_still_running(page_size):
    """A prompt prefilled in chunks of 16: a request with the same first 40 tokens admitted
    beside its last chunk reuses the two chunks computed before (the whole 40 are not in the
    tree yet)."""
    runner = FakeRunner(max_total_tokens=4096, page_size=page_size)
    sched = Scheduler(ServerArgs(chunked_prefill_size=16, page_size=page_size), runner)
    sched.check_kv = True
    rng = random.Random(1)
    head = [rng.randrange(1000) for _ in range(40)]
    a = Req("a", head + [rng.randrange(1000) for _ in range(4)], SamplingParams(max_tokens=4))
    b = Req("b", head + [7, 8, 9], SamplingParams(max_tokens=4))
    sched.add_request(a)
    sched.step()
    sched.step()
    assert a.kv_len == 32 and not a.output_ids
    run_all(sched, [b])
    assert b.cached_tokens == 32  # a's first two chunks: pages of 1 and 4 both end there
    assert runner.batches[2][1] == 2  # b was admitted in the step of a's last chunk
    assert a.output_ids == expected(a.origin_input_ids, 4)
    assert b.output_ids == expected(b.origin_input_ids, 4)
    assert assert_idle(sched)


@pytest.mark.parametrize("page_size,overlap", [(1, False), (4, False), (1, True), (4, True)])
def test_randomized_submits_aborts_preemption_and_eviction(page_size, overlap):
    """Hundreds of seeded steps on a pool too small for the load: requests from a few shared
    prefixes (some exact repeats), random aborts, preemption and eviction; the page
    accounting is checked after every step and every finished output is the hand-computed
    one."""
    rng = random.Random(100 + page_size + overlap)
    runner = FakeRunner(max_total_tokens=200, page_size=page_size, overlap=overlap)
    args = ServerArgs(chunked_prefill_size=24, page_size=page_size, max_running_requests=8)
    sched = Scheduler(args, runner)
    sched.check_kv = True
    heads = [[rng.randrange(1000) for _ in range(rng.randrange(5, 60))] for _ in range(4)]
    reqs, aborted, steps = [], set(), 0
    while steps < 600:
        if rng.random() < 0.3 and len(reqs) < 80:
            head = rng.choice(heads)
            prompt = head[: rng.randrange(1, len(head) + 1)] + \
                [rng.randrange(1000) for _ in range(rng.randrange(0, 12))]
            r = Req(f"r{len(reqs)}", prompt, SamplingParams(max_tokens=rng.randrange(1, 100)))
            reqs.append(r)
            sched.add_request(r)
        if rng.random() < 0.05 and sched.reqs:
            rid = rng.choice(sorted(sched.reqs))
            sched.abort_request(rid)
            aborted.add(rid)
        sched.step()
        steps += 1
        if len(reqs) >= 80 and not sched.has_work():
            break
    run_all(sched, [])
    assert sched.stats["preemptions"] > 0 and sched.stats["prefix_cache_hits"] > 0
    done = 0
    for r in reqs:
        assert r.finished
        if r.finished_reason.type == "abort":
            assert r.rid in aborted
            assert r.output_ids == expected(r.origin_input_ids, len(r.output_ids))
        else:
            assert r.output_ids == expected(r.origin_input_ids, r.max_new_tokens)
            done += 1
    assert done > 40
    assert assert_idle(sched)
    assert sched.flush_cache() and sched.kv_pool.used_tokens() == 0


def test_flush_is_refused_while_requests_run_and_disable_caches_nothing():
    runner = FakeRunner(max_total_tokens=512)
    sched = Scheduler(ServerArgs(), runner)
    r = Req("a", list(range(1, 30)), SamplingParams(max_tokens=50))
    sched.add_request(r)
    sched.step()
    assert not sched.flush_cache()
    run_all(sched, [])
    assert sched.kv.tree.cached_tokens() > 0
    assert sched.flush_cache() and sched.kv.tree.cached_tokens() == 0
    off = Scheduler(ServerArgs(disable_radix_cache=True), FakeRunner(max_total_tokens=512))
    a = Req("a", list(range(1, 30)), SamplingParams(max_tokens=5))
    b = Req("b", list(range(1, 30)), SamplingParams(max_tokens=5))
    run_all(off, [a])
    run_all(off, [b])
    assert off.kv_pool.used_tokens() == 0 and off.stats["prefix_cache_queries"] == 0
    assert b.output_ids == a.output_ids == expected(a.origin_input_ids, 5)


def test_lpm_serves_the_longest_cached_prefix_first():
    runner = FakeRunner(max_total_tokens=4096)
    sched = Scheduler(ServerArgs(chunked_prefill_size=1024, max_running_requests=1), runner)
    head = list(range(100, 180))
    run_all(sched, [Req("warm", head + [1], SamplingParams(max_tokens=1))])
    cold = Req("cold", list(range(500, 590)), SamplingParams(max_tokens=1))
    hot = Req("hot", head + [2, 3], SamplingParams(max_tokens=1))
    sched.add_request(cold)
    sched.add_request(hot)
    sched.step()
    assert runner.batches[-1][2] == 2  # hot went first: 2 new tokens, its 80 cached
    run_all(sched, [])
    assert cold.output_ids == expected(cold.origin_input_ids, 1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_chunked_prefill_switches_to_the_tree_copy_of_pages_it_computed_twice(page_size):
    """a and b share 20 tokens and are admitted in one step (nothing cached yet); a finishes
    at once and caches them; b's next chunk finds them in the tree: b frees its own copies
    (they are handed out again right away) and must read the tree's from then on."""
    runner = FakeRunner(max_total_tokens=4096, page_size=page_size)
    sched = Scheduler(ServerArgs(chunked_prefill_size=32, page_size=page_size), runner)
    sched.check_kv = True
    rng = random.Random(2)
    head = [rng.randrange(1000) for _ in range(20)]
    a = Req("a", head + [1], SamplingParams(max_tokens=1))
    b = Req("b", head + [rng.randrange(1000) for _ in range(60)], SamplingParams(max_tokens=3))
    run_all(sched, [a, b])
    assert runner.batches[0][1] == 2 and a.cached_tokens == b.cached_tokens == 0
    assert b.output_ids == expected(b.origin_input_ids, 3)
    assert assert_idle(sched)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prompts_sent_at_once_wait_a_step_for_their_group_head(page_size):
    """The generated-shared-prefix shape, everything submitted at once: a prompt whose
    group's system prompt is being prefilled in the same step by another request waits one
    step and then hits it, so every prompt but the first of each group hits its whole
    system prompt (the ideal), and no step prefilled two copies of one system prompt."""
    runner = FakeRunner(max_total_tokens=8192, page_size=page_size, max_running=16)
    args = ServerArgs(chunked_prefill_size=256, page_size=page_size, max_running_requests=16)
    sched = Scheduler(args, runner)
    reqs = _shared_prefix_reqs(3, 4, prefix_len=64, q_len=8, max_tokens=6, seed=3)
    run_all(sched, reqs)
    for r in reqs:
        assert r.output_ids == expected(r.origin_input_ids, 6)
    assert sched.stats["prefix_cache_hits"] == 3 * 3 * 64
    assert [r.cached_tokens for r in reqs] == [0, 64, 64, 64] * 3
    assert assert_idle(sched)
    off = Scheduler(ServerArgs(chunked_prefill_size=256, page_size=page_size,
                               max_running_requests=16, disable_radix_cache=True),
                    FakeRunner(max_total_tokens=8192, page_size=page_size, max_running=16))
    reqs_off = _shared_prefix_reqs(3, 4, prefix_len=64, q_len=8, max_tokens=6, seed=3)
    run_all(off, reqs_off)
    assert [r.output_ids for r in reqs_off] == [r.output_ids for r in reqs]


@pytest.mark.parametrize("page_size", [1, 4])
def test_twins_wait_for_the_whole_shared_prompt_of_a_chunked_prefill(page_size):
    """System prompts longer than the prefill chunk: the first prompt of a group is prefilled
    in chunks, and the others wait until all of the shared part is cached (they would hit
    only the chunks done so far if admitted beside a chunk)."""
    runner = FakeRunner(max_total_tokens=8192, page_size=page_size, max_running=16)
    args = ServerArgs(chunked_prefill_size=64, page_size=page_size, max_running_requests=16)
    sched = Scheduler(args, runner)
    reqs = _shared_prefix_reqs(3, 3, prefix_len=100, q_len=8, max_tokens=4, seed=4)
    run_all(sched, reqs)
    for r in reqs:
        assert r.output_ids == expected(r.origin_input_ids, 4)
    hits = [r.cached_tokens for r in reqs]
    assert hits[::3] == [0, 0, 0]
    # a twin admitted beside the first chunk (64 tokens) would hit at most 64; a twin waits
    # while IN_BATCH_PREFIX (32) or more shared tokens are still to be cached
    assert all(h > 100 - IN_BATCH_PREFIX for i, h in enumerate(hits) if i % 3), hits
    assert assert_idle(sched)


def test_cached_tokens_are_counted_when_a_request_is_really_admitted():
    """A request matched at the head of the queue but not admitted (no room) is matched
    again later; its reported cached tokens are those of the admission that happened (the
    position its first extend starts at), counted once."""
    class Logging(FakeRunner):
        def forward(self, batch, future_ids=None):
            self.starts = getattr(self, "starts", {})
            for req, p in zip(batch.reqs, batch.prefix_lens):
                self.starts.setdefault(req.rid, p)
            return super().forward(batch, future_ids)

    runner = Logging(max_total_tokens=256, page_size=4)
    sched = Scheduler(ServerArgs(page_size=4, max_running_requests=8,
                                 chunked_prefill_size=256), runner)
    head = list(range(100, 200))
    run_all(sched, [Req("w", head + [1], SamplingParams(max_tokens=1))])
    long = Req("long", list(range(300, 400)), SamplingParams(max_tokens=60, ignore_eos=True))
    sched.add_request(long)
    sched.step()
    r = Req("r", head + [2], SamplingParams(max_tokens=100, ignore_eos=True))
    before = sched.stats["prefix_cache_hits"]
    run_all(sched, [r])
    assert r.output_ids == expected(r.origin_input_ids, 100)
    assert r.cached_tokens == runner.starts["r"]
    assert sched.stats["prefix_cache_hits"] - before == r.cached_tokens


def test_a_decode_step_walks_the_tree_for_eviction_once(monkeypatch):
    """With the pool full of cached prefixes, a decode step of many requests evicts what it
    needs in one tree walk (one per request made a step O(requests x tree nodes))."""
    runner = FakeRunner(max_total_tokens=400, max_running=8)
    sched = Scheduler(ServerArgs(max_running_requests=8, chunked_prefill_size=1024), runner)
    # 300 one-page leaves under one shared token: each eviction of a leaf frees one page
    run_all(sched, [Req(f"w{i}", [1, 2 + i], SamplingParams(max_tokens=1))
                    for i in range(300)])
    assert runner.kv_pool.num_free_pages < 100  # the cache holds most of the pool
    reqs = [Req(f"d{i}", [900 + i] * 5, SamplingParams(max_tokens=30, ignore_eos=True))
            for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    while sched.waiting:
        sched.step()
    calls = []
    real = sched.kv.tree.evict
    monkeypatch.setattr(sched.kv.tree, "evict", lambda n: calls.append(n) or real(n))
    steps = 0
    while sched.has_work():
        before = len(calls)
        sched.step()
        steps += 1
        assert len(calls) - before <= 1
    assert calls and steps >= 20
    for r in reqs:
        assert r.output_ids == expected(r.origin_input_ids, 30)


def test_lpm_does_not_starve_a_request_without_a_cached_prefix():
    """Requests with a cached prefix keep arriving; one without, queued first, still goes
    first once it has waited LPM_MAX_WAIT_S."""
    from engine.scheduler.prefix_policy import LPM_MAX_WAIT_S

    runner = FakeRunner(max_total_tokens=4096, max_running=1)
    sched = Scheduler(ServerArgs(chunked_prefill_size=1024, max_running_requests=1), runner)
    head = list(range(100, 180))
    run_all(sched, [Req("warm", head + [1], SamplingParams(max_tokens=1))])
    cold = Req("cold", list(range(500, 590)), SamplingParams(max_tokens=1))
    hot = [Req(f"hot{i}", head + [2 + i], SamplingParams(max_tokens=1)) for i in range(3)]
    for r in [cold] + hot:
        sched.add_request(r)
    first = len(runner.batches)
    sched.step()
    assert not cold.output_ids and runner.batches[first][2] == 1  # hot0 (80 cached) first
    cold.recv_time -= LPM_MAX_WAIT_S  # it has waited long enough now
    run_all(sched, [])
    assert runner.batches[first + 1][2] == 90  # then cold's 90 tokens, before hot1 and hot2
    assert cold.output_ids == expected(cold.origin_input_ids, 1)
