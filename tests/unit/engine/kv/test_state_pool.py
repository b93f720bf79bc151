"""The recurrent-state pool (engine/kv/state_pool.py): slots, zeroing, freeing, sizes."""

from __future__ import annotations

import pytest
import torch

from engine.kv.state_pool import RecurrentStatePool, StateShape

SHAPES = [StateShape(conv_dim=12, conv_width=4, num_v_heads=2, k_head_dim=3, v_head_dim=5)] * 3


def test_alloc_free_and_zeroing():
    pool = RecurrentStatePool(2, SHAPES, torch.float32, "cpu")
    assert pool.conv_states[0].shape == (3, 12, 3)
    assert pool.recurrent_states[2].shape == (3, 2, 3, 5)
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == {1, 2} and pool.alloc() is None and pool.available() == 0
    pool.conv_states[1][a].fill_(1.0)
    pool.recurrent_states[0][a].fill_(2.0)
    pool.free(a)
    assert pool.available() == 1
    again = pool.alloc()
    assert again == a
    assert not pool.conv_states[1][a].any() and not pool.recurrent_states[0][a].any()
    with pytest.raises(ValueError, match="not held"):
        pool.free(0)
    pool.free(b)
    with pytest.raises(ValueError, match="not held"):
        pool.free(b)


def test_sizes_and_memory_line():
    per = RecurrentStatePool.bytes_per_slot(SHAPES, torch.bfloat16)
    assert per == 3 * (12 * 3 * 2 + 2 * 3 * 5 * 4)
    line = RecurrentStatePool(4, SHAPES, torch.bfloat16, "cpu").memory_line()
    assert line.startswith("recurrent state: 4 slots x 3 layers")
    with pytest.raises(ValueError, match="at least one slot"):
        RecurrentStatePool(0, SHAPES, torch.float32, "cpu")


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("temp_bytes", [1, 256 << 20])   # one layer a copy, or all at once
def test_commit_copies_scratch_slots_into_request_slots(monkeypatch, stacked, temp_bytes):
    """A verify commit: ``states[slots[i]] = states[sources[i]]`` in every layer and kind,
    nothing else touched; the same with the layers stacked in one tensor (copied in groups
    under COMMIT_TEMP_BYTES) or apart (shapes that differ)."""
    from engine.kv import state_pool as sp

    monkeypatch.setattr(sp, "COMMIT_TEMP_BYTES", temp_bytes)
    other = StateShape(conv_dim=8, conv_width=4, num_v_heads=2, k_head_dim=3, v_head_dim=5)
    shapes = SHAPES if stacked else [SHAPES[0], other, SHAPES[0]]
    pool = RecurrentStatePool(3, shapes, torch.float32, "cpu", scratch=6)
    assert pool._stacked == stacked and pool.scratch_base == 4
    assert pool.conv_states[0].shape[0] == 10 and "+ 6 scratch slots" in pool.memory_line()
    for t in (*pool.conv_states, *pool.recurrent_states):
        t.copy_(torch.randn_like(t))
    want = [t.clone() for t in (*pool.conv_states, *pool.recurrent_states)]
    for t in want:
        t[[2, 1]] = t[[7, 5]].clone()
    pool.commit([2, 1], [7, 5])
    for w, t in zip(want, (*pool.conv_states, *pool.recurrent_states)):
        assert torch.equal(w, t)
    with pytest.raises(ValueError, match="not request slots"):
        pool.commit([5], [6])


def test_build_from_specs():
    from engine.kv.state_pool import build_state_pool
    from engine.layer_spec import AttentionKind, CacheKind, LayerSpec

    full = LayerSpec(head_dim=16, v_head_dim=16, num_kv_heads=2)
    linear = LayerSpec(attention=AttentionKind.LINEAR, cache=CacheKind.RECURRENT_STATE,
                       head_dim=3, v_head_dim=5, num_kv_heads=2, state=SHAPES[0])
    assert build_state_pool([full, full], 4, torch.float32, "cpu") == (None, {})
    pool, index = build_state_pool([linear, linear, full, linear], 4, torch.float32, "cpu")
    assert index == {0: 0, 1: 1, 3: 2} and len(pool.conv_states) == 3 and pool.num_slots == 4
    with pytest.raises(ValueError, match="without its shape"):
        build_state_pool([LayerSpec(attention=AttentionKind.LINEAR, head_dim=3, v_head_dim=5,
                                    num_kv_heads=2, cache=CacheKind.RECURRENT_STATE)],
                         4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="belongs to recurrent_state"):
        LayerSpec(head_dim=16, v_head_dim=16, num_kv_heads=2, state=SHAPES[0])


def test_kv_manager_takes_and_gives_back_state_slots():
    """KVCacheManager: an admitted request takes a zeroed slot with its row, ``release``
    (finish, abort, preemption) gives it back, ``check`` proves the count and catches a leak."""
    from types import SimpleNamespace

    from engine.kv.manager import KVCacheManager
    from engine.kv.pool import KVPool, ReqToTokenPool

    pool = RecurrentStatePool(2, SHAPES, torch.float32, "cpu")
    kv = KVCacheManager(KVPool(64, 4, 1, 1, 8, torch.float32, "cpu"), ReqToTokenPool(2, 32, "cpu"),
                        disable_cache=True, state_pool=pool)

    def req():
        return SimpleNamespace(pages=[], kv_len=0, cached_pages=0, last_node=None,
                               req_pool_idx=None, state_slot=None, lora_id=None,
                               prompt_logprobs=None)

    a, b, c = req(), req(), req()
    for r in (a, b):
        assert kv.state_available()
        kv.take_state(r)
    assert {a.state_slot, b.state_slot} == {1, 2} and not kv.state_available()
    kv.take_state(a)                              # already holds one: unchanged
    assert pool.available() == 0
    with pytest.raises(RuntimeError, match="no recurrent-state slot"):
        kv.take_state(c)
    kv.check([a, b, c])
    pool.recurrent_states[0][a.state_slot].fill_(3.0)
    kv.release(a)
    assert a.state_slot is None and kv.state_available()
    kv.check([a, b, c])
    kv.take_state(c)                              # the recycled slot, zeroed
    assert not pool.recurrent_states[0][c.state_slot].any()
    c.state_slot = None                           # a slot lost by its owner
    with pytest.raises(AssertionError, match="recurrent-state slots lost"):
        kv.check([a, b, c])
