"""KV pool and req_to_token bookkeeping against hand-computed values."""

import torch

from engine.kv.pool import KVPool, ReqToTokenPool


def test_pool_shapes_and_padding_page():
    kv = KVPool(num_tokens=100, page_size=16, num_layers=2, num_kv_heads=3, head_dim=8,
                dtype=torch.float32, device="cpu")
    # 100 tokens -> 6 whole pages (96 tokens) plus the reserved page 0
    assert kv.capacity_tokens == 96
    assert kv.num_slots == 7 * 16
    assert kv.k_buffers[0].shape == (112, 3, 8)
    assert kv.free_tokens() == 96 and kv.used_tokens() == 0
    pages = kv.alloc_pages(6)
    assert 0 not in pages and sorted(pages) == [1, 2, 3, 4, 5, 6]
    assert kv.alloc_pages(1) is None  # nothing taken when short
    kv.free_pages(pages)
    assert kv.free_tokens() == 96
    assert KVPool.bytes_per_token(30, 3, 64, torch.float32) == 2 * 30 * 3 * 64 * 4


def test_slots_for_pages():
    kv = KVPool(num_tokens=64, page_size=4, num_layers=1, num_kv_heads=1, head_dim=2,
                dtype=torch.float32, device="cpu")
    # a request holding pages [5, 2] has positions 0..7 at slots 20..23, 8..11
    assert kv.slots_for([5, 2], 0, 8) == [20, 21, 22, 23, 8, 9, 10, 11]
    assert kv.slots_for([5, 2], 3, 6) == [23, 8, 9]
    # 6 tokens in 2 pages, growing by 3 needs ceil(9/4)=3 pages: one more
    assert kv.pages_needed(6, 2, 3) == 1
    assert kv.pages_needed(6, 2, 2) == 0
    kv1 = KVPool(num_tokens=8, page_size=1, num_layers=1, num_kv_heads=1, head_dim=2,
                 dtype=torch.float32, device="cpu")
    assert kv1.slots_for([7, 3, 5], 1, 3) == [3, 5]


def test_req_to_token_rows():
    pool = ReqToTokenPool(size=3, max_context_len=10, device="cpu")
    assert pool.req_to_token.shape == (4, 10)
    rows = [pool.alloc(), pool.alloc(), pool.alloc()]
    assert sorted(rows) == [1, 2, 3] and pool.alloc() is None
    pool.free(rows[0])
    assert pool.available() == 1


def test_req_token_access_matches_fill_ids():
    from engine.sampling.params import SamplingParams
    from engine.scheduler.request import Req

    r = Req("a", [10, 11, 12], SamplingParams())
    r.output_ids = [20, 21]
    fill = r.fill_ids
    assert fill == [10, 11, 12, 20, 21]
    assert [r.token_at(i) for i in range(5)] == fill
    for start in range(5):
        for count in range(0, 6 - start):
            assert r.tokens(start, count) == fill[start: start + count]


def test_grow_appends_pages_and_returns_slots():
    kv = KVPool(num_tokens=16, page_size=4, num_layers=1, num_kv_heads=1, head_dim=2,
                dtype=torch.float32, device="cpu")
    pages: list[int] = []
    first = kv.grow(pages, 0, 3)          # 3 tokens: one page
    assert len(pages) == 1 and first == [pages[0] * 4 + i for i in range(3)]
    second = kv.grow(pages, 3, 2)         # positions 3, 4: fills page 1, opens page 2
    assert len(pages) == 2 and second == [pages[0] * 4 + 3, pages[1] * 4]
    assert kv.grow(pages, 5, 100) is None and len(pages) == 2  # nothing taken when short
    assert kv.free_tokens() == 16 - 8
