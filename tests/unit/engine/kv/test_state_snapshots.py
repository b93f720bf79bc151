"""State snapshots (engine/kv/state_snapshots.py) and their bookkeeping in the radix tree
(engine/kv/radix_cache.py): copies, the match cut back to a snapshot, splits, locks, LRU
eviction with the pages and by itself, pruning, flush; the KV manager's snapshots of a
request (taken, attached at release, restored on a hit, chunk ends picked); and rank 0's
record of its copies, which a tensor-parallel worker's pool repeats."""

from __future__ import annotations

import pytest
import torch

from engine.kv.manager import BRANCH_SNAPSHOT_MIN, KVCacheManager
from engine.kv.pool import KVPool, ReqToTokenPool
from engine.kv.radix_cache import RadixCache
from engine.kv.state_pool import RecurrentStatePool, StateShape
from engine.kv.state_snapshots import (
    MAX_SNAPSHOTS_PER_SLOT,
    RESTORE,
    TAKE,
    StateSnapshotPool,
    default_snapshot_count,
)
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req

SHAPES = [StateShape(conv_dim=6, conv_width=3, num_v_heads=2, k_head_dim=2, v_head_dim=3)] * 2


def _pools(num_snaps: int = 4):
    states = RecurrentStatePool(2, SHAPES, torch.float32, "cpu")
    return states, StateSnapshotPool(states, num_snaps)


def _tree(page_size: int = 1, num_snaps: int = 4):
    kv = KVPool(256, page_size, 1, 1, 1, torch.float32, "cpu")
    states, snaps = _pools(num_snaps)
    return kv, snaps, RadixCache(kv, snapshots=snaps)


def _insert(kv, tree, seq):
    pages = kv.alloc_pages(len(seq) // kv.page_size)
    n_old, node = tree.insert(seq, pages)
    kv.free_pages(pages[:n_old])  # the duplicates of pages the tree held already
    return node


def _snap_at(tree, snaps, seq) -> int:
    s = snaps.alloc()
    assert tree.attach_snapshot(seq, s)
    return s


def test_save_restore_alloc_and_sizes():
    states, snaps = _pools(2)
    slot = states.alloc()
    for t in (*states.conv_states, *states.recurrent_states):
        t[slot].normal_()
    want = [t[slot].clone() for t in (*states.conv_states, *states.recurrent_states)]
    s = snaps.alloc()
    snaps.save(slot, s)
    other = states.alloc()
    snaps.restore(s, other)
    for w, t in zip(want, (*states.conv_states, *states.recurrent_states)):
        assert torch.equal(t[other], w)
    # a step's rows at once: slots 2 and 1 into two snapshots
    for t in (*states.conv_states, *states.recurrent_states):
        t[other].normal_()
    s2 = snaps.alloc()
    snaps.save_many([other, slot], [s2, s])
    for t, src in zip((*snaps.conv, *snaps.recurrent),
                      (*states.conv_states, *states.recurrent_states)):
        assert torch.equal(t[s2], src[other]) and torch.equal(t[s], src[slot])
    assert snaps.alloc() is None
    snaps.free(s2)
    snaps.free(s)
    with pytest.raises(ValueError, match="not held"):
        snaps.free(s)
    assert snaps.alloc() is not None and snaps.alloc() is not None and snaps.alloc() is None
    with pytest.raises(ValueError, match="at least one"):
        StateSnapshotPool(states, 0)
    assert snaps.bytes_per_snapshot == RecurrentStatePool.bytes_per_slot(SHAPES, torch.float32)
    assert snaps.memory_line().startswith("state snapshots (prefix cache): 2 x ")
    assert default_snapshot_count(1000, 10, 100) == 10          # a tenth of the KV bytes
    assert default_snapshot_count(1, 10, 100) == 1               # at least one
    assert default_snapshot_count(1e12, 10, 3) == MAX_SNAPSHOTS_PER_SLOT * 3


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_is_cut_back_to_the_deepest_snapshot(page_size):
    kv, snaps, tree = _tree(page_size)
    seq = list(range(10, 34))                       # 24 tokens
    _insert(kv, tree, seq)
    pages, node, full = tree.match_branch(seq + [1, 2])
    assert (pages, node, full) == ([], tree.root, 24)   # KV without a snapshot: no match
    s8 = _snap_at(tree, snaps, seq[:8])
    s16 = _snap_at(tree, snaps, seq[:16])
    assert not tree.attach_snapshot(seq[:16], snaps.alloc())   # that node has one
    assert not tree.attach_snapshot(seq[:8] + [99] * 8, 1)    # not in the tree
    if page_size > 1:
        assert not tree.attach_snapshot(seq[:6], 1)           # not a page boundary
    pages, node, full = tree.match_branch(seq[:20] + [0] * 4)
    assert len(pages) * page_size == 16 and node.snap == s16 and full == 20
    pages, node = tree.match_prefix(seq[:12])
    assert len(pages) * page_size == 8 and node.snap == s8
    assert tree.snapshot_count == 2 and sorted(tree.tree_snapshots()) == sorted([s8, s16])
    # a split keeps each snapshot at its node's end
    _insert(kv, tree, seq[:4] + [7] * 8)
    assert tree.match_prefix(seq)[1].snap == s16
    assert tree.match_kv(seq)[0] == tree.match_kv(seq + [1])[0]


def test_eviction_frees_snapshots_and_locks_protect_them():
    kv, snaps, tree = _tree(1, num_snaps=3)
    a, b = list(range(1, 13)), list(range(1, 7)) + list(range(50, 56))
    _insert(kv, tree, a)
    _insert(kv, tree, b)
    s_mid = _snap_at(tree, snaps, a[:6])            # an inner node (two children)
    s_a = _snap_at(tree, snaps, a)
    s_b = _snap_at(tree, snaps, b)
    assert snaps.available() == 0
    _, node = tree.match_prefix(a)
    tree.lock(node)                                 # a reader of ``a`` holds its path
    # least recently used first: b's leaf (a was just touched); it goes whole
    assert tree.evict_snapshot()
    assert snaps.available() == 1 and s_b not in tree.tree_snapshots()
    assert tree.match_kv(b)[0] == tree.match_kv(a[:6])[0]       # b's tail pages freed
    assert not tree.evict_snapshot()                # s_mid and s_a are locked
    tree.unlock(node)
    tree.match_kv(a[:6])[1].last_access = 0.0       # the inner node is the older one
    assert tree.evict_snapshot()                    # s_mid: an inner node keeps its KV
    assert tree.tree_snapshots() == [s_a] and len(tree.match_kv(a)[0]) == 12
    assert s_mid not in tree.tree_snapshots()
    tree.evict(100)                                 # the pages' eviction frees snapshots
    assert snaps.available() == 3 and tree.snapshot_count == 0 and tree.total_pages == 0
    assert kv.num_free_pages == kv.num_pages


def test_prune_and_flush():
    kv, snaps, tree = _tree(1)
    seq = list(range(1, 21))
    node = _insert(kv, tree, seq)
    _snap_at(tree, snaps, seq[:8])
    tree.prune(tree.match_kv(seq)[1])               # the dead tail past the snapshot goes
    assert len(tree.match_kv(seq)[0]) == 8 and tree.total_pages == 8
    assert node.parent is not None
    _insert(kv, tree, seq)
    _snap_at(tree, snaps, seq)
    assert tree.flush()
    assert snaps.available() == 4 and tree.total_pages == 0 and tree.snapshot_count == 0


def _manager(page_size: int = 1):
    kv_pool = KVPool(512, page_size, 1, 1, 1, torch.float32, "cpu")
    states, snaps = _pools(4)
    return KVCacheManager(kv_pool, ReqToTokenPool(2, 256, "cpu"), state_pool=states,
                          snapshots=snaps)


def _admit(kv, req, n=None):
    kv.match(req)
    req.req_pool_idx = kv.req_pool.alloc()
    kv.write_prefix(req)
    kv.take_state(req)
    n = kv.chunk_len(req, req.seq_len - req.kv_len if n is None else n)
    kv.grow(req, n)
    req.kv_len += n
    return n


def test_manager_snapshots_a_request_and_restores_it():
    kv = _manager()
    first = Req("a", list(range(3, 43)), SamplingParams())      # 40 tokens
    assert _admit(kv, first) == 40
    kv.state_pool.recurrent_states[1][first.state_slot].fill_(3.0)
    kv.snapshot(first)                               # after its prefill's forward
    assert [b for b, _ in first.state_snaps] == [40]
    first.output_ids = [7, 8]
    kv.grow(first, 1)
    first.kv_len += 1                                # one decode step: 41 tokens fed
    kv.release(first)                                # a second snapshot at 41
    assert first.state_snaps == [] and kv.tree.snapshot_count == 2
    kv.check([first])
    # a longer prompt hits 41 tokens and starts from the snapshot's states
    second = Req("b", list(range(3, 43)) + [7, 8, 9], SamplingParams())
    _admit(kv, second)
    assert second.cached_pages == 41
    assert torch.equal(kv.state_pool.recurrent_states[1][second.state_slot],
                       torch.full((2, 2, 3), 3.0))
    kv.check([second])
    # a prompt sharing 35 tokens: no snapshot there, so it stops its prefill at 35
    third = Req("c", list(range(3, 38)) + [1] * 5, SamplingParams())
    assert BRANCH_SNAPSHOT_MIN <= 35
    kv.release(second)
    assert _admit(kv, third) == 35 and third.kv_len == 35 and third.cached_pages == 0
    kv.release(third)
    kv.check([])


def test_recorded_copies_replay_on_a_worker_pool():
    """Rank 0 of a tensor-parallel group records the copies its manager makes (a take at
    release, a restore at admission; ``pending``), not the prefill takes the runner makes
    after the forward (``snapshot_rows(copy=False)``, ``record=False``); a worker's pool that
    repeats both in rank 0's order ends with the same snapshots and slot states."""
    kv = _manager()
    snaps, states = kv.snapshots, kv.state_pool
    snaps.pending = []
    w_states, w_snaps = _pools(4)
    first = Req("a", list(range(3, 43)), SamplingParams())
    _admit(kv, first)
    takes = kv.snapshot_rows([first], copy=False)     # the scheduler, launching the step
    assert takes == [(first.state_slot, first.state_snaps[0][1])]
    assert snaps.take_pending() == []

    def forward(value):  # both ranks' forward writes the slot
        for pool in (states, w_states):
            for t in (*pool.conv_states, *pool.recurrent_states):
                t[first.state_slot].fill_(value)

    forward(3.0)
    for pool in (snaps, w_snaps):                     # the runner, after launching it
        pool.save_many([takes[0][0]], [takes[0][1]], record=False)
    assert snaps.take_pending() == []
    first.output_ids = [7, 8]
    kv.grow(first, 1)
    first.kv_len += 1
    forward(5.0)
    kv.release(first)                                 # a take at 41
    second = Req("b", list(range(3, 43)) + [7, 8, 9], SamplingParams())
    _admit(kv, second)                                # restores the snapshot at 41
    ops = snaps.take_pending()
    assert [op for op, _, _ in ops] == [TAKE, RESTORE] and snaps.pending == []
    assert ops[1][1] == second.state_slot
    w_snaps.apply(ops)
    used = {takes[0][1], ops[0][2]}
    for a, b in zip((*snaps.conv, *snaps.recurrent), (*w_snaps.conv, *w_snaps.recurrent)):
        assert all(torch.equal(a[i], b[i]) for i in used)
    for a, b in zip((*states.conv_states, *states.recurrent_states),
                    (*w_states.conv_states, *w_states.recurrent_states)):
        assert torch.equal(a[second.state_slot], b[second.state_slot])
        assert a[second.state_slot].eq(5.0).all()
    with pytest.raises(ValueError, match="unknown"):
        w_snaps.apply([(7, 1, 1)])


def test_chunk_ends_on_pages_and_the_prompts_last_page():
    kv = _manager(page_size=4)
    req = Req("a", list(range(3, 33)), SamplingParams())         # 30 tokens
    assert _admit(kv, req, 10) == 8                  # a middle chunk ends on a page
    assert kv.chunk_len(req, 22) == 20               # then at the prompt's last page (28)
    assert kv.chunk_len(req, 3) == 3                 # a chunk inside one page stays
    kv.release(req, cache=False)
    kv.check([])
