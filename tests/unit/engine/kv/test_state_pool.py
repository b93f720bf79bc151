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
