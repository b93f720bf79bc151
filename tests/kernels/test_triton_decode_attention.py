"""Triton paged decode attention vs ``kernels.reference.decode_attention_ref``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import (
    DEVICE,
    GPU_MARKS,
    assert_close,
    gpu_only,
    make_paged_batch,
    nan_like,
    randn,
)

from engine import device as devlib
from kernels.decode_attention import DEFAULT_MIN_CHUNK, choose_num_kv_splits, decode_attention_fwd
from kernels.reference import decode_attention_ref

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16

# (group, num_kv_heads, head_dim, page_size, dtype, seq_lens): a pruned cross product that
# covers GQA groups 1/3/8, head dims 64/128 (+80), pages 1/16, batch 1 and several, lengths
# below / not a multiple of / several times BLOCK_N.
CASES = [
    pytest.param(1, 2, 64, 1, F32, [1, 77, 300], id="mha-d64-p1-f32"),
    pytest.param(3, 3, 64, 16, F16, [200], id="g3-d64-p16-f16-bs1"),
    pytest.param(8, 1, 128, 16, F32, [5, 129, 513, 64], id="g8-d128-p16-f32"),
    pytest.param(3, 2, 128, 1, F16, [33, 250, 400, 17, 90], id="g3-d128-p1-f16"),
    pytest.param(8, 2, 64, 1, F16, [700], id="g8-d64-p1-f16-bs1"),
    pytest.param(1, 4, 128, 16, F16, [65, 190], id="mha-d128-p16-f16"),
    pytest.param(4, 2, 80, 16, F16, [100, 31], id="g4-d80-p16-f16"),
    pytest.param(8, 8, 128, 16, BF16, [1000, 3000, 4097, 1, 255, 2048], id="g8-d128-bf16-big",
                 marks=GPU_MARKS),
    pytest.param(4, 8, 128, 1, BF16, [8192, 513], id="g4-d128-p1-bf16-long", marks=GPU_MARKS),
    # Gemma 4's heads: 256 on its sliding layers, 512 on its global layers
    pytest.param(8, 1, 256, 16, BF16, [1000, 31, 4097], id="g8-d256-bf16-gemma4",
                 marks=GPU_MARKS),
    pytest.param(8, 1, 512, 16, BF16, [1000, 31, 4097], id="g8-d512-bf16-gemma4-global",
                 marks=GPU_MARKS),
]


def _run(group, hkv, d, page, dtype, lens, splits, seed, max_kv_splits=16):
    batch = make_paged_batch([n for n in lens], None, num_kv_heads=hkv, head_dim=d,
                             page_size=page, dtype=dtype, seed=seed)
    hq = group * hkv
    q = randn((len(lens), hq, d), dtype, seed + 1, scale=2.0)
    ref = torch.empty_like(q)
    decode_attention_ref(q, batch.k_buffer, batch.v_buffer, ref, batch.req_to_token,
                         batch.req_pool_indices, batch.seq_lens, d ** -0.5)
    o = nan_like(q)
    decode_attention_fwd(q, batch.k_buffer, batch.v_buffer, o, batch.req_to_token,
                         batch.req_pool_indices, batch.seq_lens, d ** -0.5,
                         num_kv_splits=splits, max_kv_splits=max_kv_splits,
                         num_sms=devlib.multiprocessor_count(q.device.type))
    return o, ref


@pytest.mark.parametrize("group,hkv,d,page,dtype,lens", CASES)
@pytest.mark.parametrize("split_mode", ["auto", "explicit"])
def test_decode_matches_reference(group, hkv, d, page, dtype, lens, split_mode):
    if split_mode == "auto":
        splits = None   # chosen inside from the device's SM/core count
    else:
        # Per-request counts: 1, many, and more splits than the sequence has tiles (empty
        # splits must weigh 0), cycling over the batch.
        pattern = [3, 1, 16, 5, 2]
        splits = torch.tensor([pattern[i % 5] for i in range(len(lens))], dtype=torch.int32,
                              device=DEVICE)
    o, ref = _run(group, hkv, d, page, dtype, lens, splits, seed=len(lens) * 7 + d)
    assert_close(o, ref, dtype, f"decode {split_mode}")


def test_decode_static_workspaces_and_clamped_splits():
    """Graph-style call: oversized NaN-poisoned workspaces, split counts out of range."""
    group, hkv, d, dtype, lens = 3, 2, 64, F16, [90, 1, 260]
    batch = make_paged_batch(lens, None, num_kv_heads=hkv, head_dim=d, page_size=16,
                             dtype=dtype, seed=11)
    hq, max_splits = group * hkv, 4
    q = randn((len(lens), hq, d), dtype, 12)
    logits = torch.full((8, hq, max_splits, d), float("nan"), dtype=F32, device=DEVICE)
    lse = torch.full((8, hq, max_splits), float("nan"), dtype=F32, device=DEVICE)
    splits = torch.tensor([0, 7, 4], dtype=torch.int32, device=DEVICE)  # 0 -> 1, 7 -> 4
    o = nan_like(q)
    decode_attention_fwd(q, batch.k_buffer, batch.v_buffer, o, batch.req_to_token,
                         batch.req_pool_indices, batch.seq_lens, d ** -0.5,
                         num_kv_splits=splits, max_kv_splits=max_splits,
                         attn_logits=logits, attn_lse=lse)
    ref = torch.empty_like(q)
    decode_attention_ref(q, batch.k_buffer, batch.v_buffer, ref, batch.req_to_token,
                         batch.req_pool_indices, batch.seq_lens, d ** -0.5)
    assert_close(o, ref, dtype, "decode with static workspaces")


def test_decode_strided_q_and_zero_length_padding_row():
    """q sliced out of a fused qkv tensor; a graph padding row (row 0, seq_len 0) gives 0."""
    group, hkv, d, dtype = 8, 1, 64, F32
    batch = make_paged_batch([130, 40], None, num_kv_heads=hkv, head_dim=d, page_size=1,
                             dtype=dtype, seed=5)
    hq = group * hkv
    qkv = randn((3, (hq + 2 * hkv) * d), dtype, 6)
    q = qkv[:, : hq * d].view(3, hq, d)                      # row stride (hq + 2hkv) * d
    rows = torch.cat([batch.req_pool_indices, torch.zeros(1, dtype=torch.int64,
                                                          device=DEVICE)])
    lens = torch.cat([batch.seq_lens, torch.zeros(1, dtype=torch.int32, device=DEVICE)])
    ref = torch.empty_like(q)
    decode_attention_ref(q, batch.k_buffer, batch.v_buffer, ref, batch.req_to_token, rows,
                         lens, d ** -0.5)
    o = torch.full((3, hq, d), float("nan"), dtype=dtype, device=DEVICE)
    decode_attention_fwd(q, batch.k_buffer, batch.v_buffer, o, batch.req_to_token, rows, lens,
                         d ** -0.5, num_kv_splits=torch.tensor([2, 1, 1], dtype=torch.int32,
                                                               device=DEVICE))
    # The kernel's contract for an empty KV (a graph padding row) is a zero output; the
    # reference has no such row semantics (softmax over nothing), so compare rows 0..1.
    assert torch.equal(o[2].cpu(), torch.zeros(hq, d)), "seq_len 0 must give a zero output"
    assert_close(o[:2], ref[:2], dtype, "decode strided q")


def test_decode_many_query_heads_per_kv_head():
    """Group size 72 > 64 rows: the query heads of one KV head span two head blocks."""
    o, ref = _run(72, 1, 64, 1, F32, [70, 3], None, seed=3)
    assert_close(o, ref, F32, "decode group 72")


def test_decode_rejects_bad_workspace():
    batch = make_paged_batch([10], None, num_kv_heads=1, head_dim=64, page_size=1,
                             dtype=F32, seed=1)
    q = randn((1, 2, 64), F32, 2)
    with pytest.raises(ValueError):
        decode_attention_fwd(q, batch.k_buffer, batch.v_buffer, torch.empty_like(q),
                             batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                             0.125, max_kv_splits=8,
                             attn_logits=torch.empty((1, 2, 4, 64), device=DEVICE))


def test_choose_num_kv_splits_hand_checked():
    # B=5, 8 KV heads, 132 SMs: fill = ceil(132 / 40) = 4; by length: L // min_chunk.
    lens = torch.tensor([0, 127, 128, 1000, 100000], dtype=torch.int32, device=DEVICE)
    got = choose_num_kv_splits(lens, 8, 16, 132, min_chunk=128)
    assert got.dtype == torch.int32 and got.device.type == DEVICE
    assert got.tolist() == [1, 1, 1, 4, 4]
    assert DEFAULT_MIN_CHUNK == 32   # the hand values below assume it
    assert choose_num_kv_splits(lens, 8, 16, 132).tolist() == [1, 3, 4, 4, 4]
    # B=1: fill = ceil(132 / 8) = 17, capped by max_kv_splits 16.
    one = lambda n, c=128: choose_num_kv_splits(
        torch.tensor([n], device=DEVICE), 8, 16, 132, min_chunk=c).tolist()
    assert one(8192) == [16] and one(1000) == [7] and one(300) == [2] and one(5) == [1]
    assert one(1000, 32) == [16] and one(300, 32) == [9] and one(40, 32) == [1]
    # Large batch fills the SMs by itself: one split each.
    assert choose_num_kv_splits(torch.full((64,), 50000, device=DEVICE), 8, 16,
                                132).tolist() == [1] * 64
    # min_chunk and out=
    out = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    res = choose_num_kv_splits(torch.tensor([640, 64], device=DEVICE), 1, 8, 100,
                               min_chunk=64, out=out)
    assert res is out and out.tolist() == [8, 1]


def test_choose_num_kv_splits_bounds():
    g = torch.Generator().manual_seed(0)
    for bs, hkv, max_splits, sms in [(1, 8, 16, 132), (3, 1, 4, 20), (17, 2, 32, 80),
                                     (256, 8, 16, 132)]:
        lens = torch.randint(0, 20000, (bs,), generator=g).to(DEVICE)
        s = choose_num_kv_splits(lens, hkv, max_splits, sms).cpu()
        assert (s >= 1).all() and (s <= max_splits).all()
        multi = s > 1   # a real split is never shorter than min_chunk on average
        assert ((lens.cpu()[multi] + s[multi] - 1) // s[multi] >= DEFAULT_MIN_CHUNK).all()
        assert int(s.max()) <= -(-sms // (bs * hkv))   # no more than needed to fill SMs
    with pytest.raises(ValueError):
        choose_num_kv_splits(torch.ones(1, device=DEVICE), 1, 0, 1)


@gpu_only
def test_decode_graph_capture_replay():
    """choose_num_kv_splits + decode captured in a graph (fails on any host sync)."""
    graph_cls = devlib.graph_class(DEVICE)
    if graph_cls is None:
        pytest.skip("no graphs on this device")
    group, hkv, d, dtype = 4, 2, 128, BF16
    batch = make_paged_batch([300, 2000, 40], None, num_kv_heads=hkv, head_dim=d,
                             page_size=16, dtype=dtype, seed=21)
    hq, bs, max_splits = group * hkv, 3, 16
    q = randn((bs, hq, d), dtype, 22)
    o = torch.zeros_like(q)
    seq_lens = batch.seq_lens.clone()
    splits = torch.empty(bs, dtype=torch.int32, device=DEVICE)
    logits = torch.empty((bs, hq, max_splits, d), dtype=F32, device=DEVICE)
    lse = torch.empty((bs, hq, max_splits), dtype=F32, device=DEVICE)
    sms = devlib.multiprocessor_count(DEVICE)

    def step():
        choose_num_kv_splits(seq_lens, hkv, max_splits, sms, out=splits)
        decode_attention_fwd(q, batch.k_buffer, batch.v_buffer, o, batch.req_to_token,
                             batch.req_pool_indices, seq_lens, d ** -0.5, num_kv_splits=splits,
                             max_kv_splits=max_splits, attn_logits=logits, attn_lse=lse)

    step()  # warm up: compile outside the capture
    devlib.synchronize(DEVICE)
    graph = graph_cls()
    with devlib.graph_context(DEVICE, graph):
        step()
    for new_lens in ([300, 2000, 40], [17, 1999, 40]):
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(randn((bs, hq, d), dtype, sum(new_lens)))
        o.fill_(float("nan"))
        graph.replay()
        devlib.synchronize(DEVICE)
        ref = torch.empty_like(q)
        decode_attention_ref(q, batch.k_buffer, batch.v_buffer, ref, batch.req_to_token,
                             batch.req_pool_indices, seq_lens, d ** -0.5)
        assert_close(o, ref, dtype, f"graph replay {new_lens}")

