"""Triton MLA kernels (``kernels/mla/``) vs the torch reference ``kernels.mla.reference``:
the absorbed-form decode over the latent pool (several requests of different lengths,
pages of 1 and 16 tokens, forced and automatic splits) and the MHA-form extend over the
decompressed K/V (prefix hits, chunked extends, a fresh prefill). Pools are hostile as in
``kernel_test_utils``: shuffled pages and rows, NaN in every slot no request owns. An FP8
latent pool (e4m3 and e5m2 holding ``latent / kv_scale``, scales 1 and not) against the
reference over the dequantized pool: the decode (fp16 dots on fp16 and fp32 queries) and the
extend over its rows as the layer gathers them (``engine.layers.mla.latent_rows``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, GPU_MARKS, assert_close, make_paged_batch, randn

from kernels.mla.decode import (
    choose_mla_splits,
    mla_decode_fwd,
    mla_decode_workspaces,
    mla_split_cap,
)
from kernels.mla.prefill import mla_prefill_fwd, ragged_latent_slots
from kernels.mla.reference import mla_attention_ref

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _latent_batch(prefix, extend, r, p, page, dtype, seed):
    """A latent pool ``[S, 1, R + P]`` holding every token of every request (the new ones
    too: the layer stores them before it attends)."""
    batch = make_paged_batch(prefix, extend, num_kv_heads=1, head_dim=r + p, page_size=page,
                             dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    for b, (pre, ext) in enumerate(zip(prefix, extend)):
        row = int(batch.req_pool_indices[b])
        slots = batch.req_to_token[row, pre:pre + ext].long()
        batch.k_buffer[slots] = torch.randn((ext, 1, r + p), generator=g).to(dtype).to(DEVICE)
    return batch


def _reference(q_abs, batch, extend, scale, r):
    seq = batch.seq_lens.tolist()
    return mla_attention_ref(q_abs, batch.k_buffer, batch.req_to_token,
                             batch.req_pool_indices.tolist(), seq, extend, scale, r)


DECODE = [
    pytest.param(20, 32, 16, 16, F32, [1, 37, 130, 64], None, id="h20-p16-f32-auto"),
    pytest.param(16, 32, 16, 1, F16, [200, 5, 97], 4, id="h16-p1-f16-4splits"),
    pytest.param(3, 16, 8, 16, F32, [45, 17], 3, id="h3-tiny-dims-f32"),
    pytest.param(7, 64, 16, 1, F16, [300], 7, id="h7-bs1-f16-7splits"),
    pytest.param(128, 512, 64, 16, BF16, [4096, 1, 1000, 33, 2500, 129], None,
                 id="v3-shape-bf16", marks=GPU_MARKS),
]


@pytest.mark.parametrize("h,r,p,page,dtype,lens,splits", DECODE)
def test_mla_decode_matches_reference(h, r, p, page, dtype, lens, splits):
    batch = _latent_batch([n - 1 for n in lens], [1] * len(lens), r, p, page, dtype, seed=3)
    bs, scale = len(lens), 0.3
    q_lat, q_pe = randn((bs, h, r), dtype, 11), randn((bs, h, p), dtype, 12)
    ref = _reference(torch.cat([q_lat, q_pe], -1), batch, [1] * bs, scale, r)
    if splits is None:
        cap = mla_split_cap(bs, h, num_sms=8, waves=1, max_kv_splits=16)
        num = choose_mla_splits(batch.seq_lens, h, cap, num_sms=8, min_chunk=16)
    else:
        cap, num = splits, torch.full((bs,), splits, dtype=torch.int32, device=DEVICE)
    o = torch.full((bs, h, r), float("nan"), dtype=dtype, device=DEVICE)
    logits, lse = mla_decode_workspaces(bs, h, cap, r, DEVICE)
    mla_decode_fwd(q_lat, q_pe, batch.k_buffer, o, batch.req_to_token, batch.req_pool_indices,
                   batch.seq_lens, scale, num, cap, logits, lse)
    assert_close(o, ref, dtype, f"mla decode {h} heads, {cap} splits")


def test_split_cap_bounds_the_workspace():
    # one request: the grid fills the SMs; many: one split; the values never below 1
    assert mla_split_cap(1, 128, 132, 1, 16) == 16
    assert mla_split_cap(64, 128, 132, 1, 16) == 1
    assert mla_split_cap(4, 16, 132, 1, 64) == 33
    sizes = [b * 128 * mla_split_cap(b, 128, 132, 1, 16) for b in range(1, 257)]
    assert max(sizes) <= (132 + 256 * 8) * 16


EXTEND = [
    # (prefix, extend): a fresh prefill, prefix hits, a chunk after a chunk, one-token rows
    pytest.param(5, 16, 8, 16, F32, [0, 40, 17, 0], [23, 9, 30, 1], 16, id="f32-p16"),
    pytest.param(4, 16, 16, 24, F16, [64, 0, 3], [64, 70, 1], 1, id="f16-p1"),
    pytest.param(3, 8, 4, 6, F32, [10], [7], 16, id="tiny-dims"),
    pytest.param(16, 128, 64, 128, BF16, [0, 1000, 64, 300], [700, 257, 64, 1], 16,
                 id="v3-head-bf16", marks=GPU_MARKS),
]


@pytest.mark.parametrize("h,n,p,v,dtype,prefix,extend,page", EXTEND)
def test_mla_prefill_matches_reference(h, n, p, v, dtype, prefix, extend, page):
    r = 32 if n < 128 else 512
    batch = _latent_batch(prefix, extend, r, p, page, dtype, seed=5)
    t, scale = sum(extend), (n + p) ** -0.5
    q_nope, q_pe = randn((t, h, n), dtype, 21), randn((t, h, p), dtype, 22)
    w_uk = randn((h, n, r), F32, 23, scale=r ** -0.5).to(dtype)
    w_uv = randn((h, v, r), F32, 24, scale=r ** -0.5).to(dtype)
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float()),
                       q_pe.float()], -1)
    o_lat = _reference(q_abs, batch, extend, scale, r)
    ref = torch.einsum("thr,hvr->thv", o_lat, w_uv.float())

    total = int(batch.seq_lens.sum())
    slots, kv_start = ragged_latent_slots(batch.req_to_token, batch.req_pool_indices,
                                          batch.seq_lens, total)
    rows = batch.k_buffer[slots, 0]
    c = rows[:, :r].float()
    k_nope = torch.einsum("sr,hnr->shn", c, w_uk.float()).to(dtype)
    vals = torch.einsum("sr,hvr->shv", c, w_uv.float()).to(dtype)
    ext = torch.tensor(extend, dtype=torch.int32, device=DEVICE)
    q_start = (torch.cumsum(ext, 0) - ext).to(torch.int32)
    o = torch.full((t, h, v), float("nan"), dtype=dtype, device=DEVICE)
    mla_prefill_fwd(q_nope, q_pe, k_nope, rows[:, r:], vals, o, batch.seq_lens, ext, q_start,
                    kv_start, scale, max(extend))
    assert_close(o, ref, dtype, "mla prefill")


def test_ragged_slots_follow_req_to_token():
    batch = _latent_batch([3, 0], [2, 4], 16, 16, 1, F32, seed=9)
    slots, starts = ragged_latent_slots(batch.req_to_token, batch.req_pool_indices,
                                        batch.seq_lens, 9)
    rows = batch.req_pool_indices.tolist()
    want = batch.req_to_token[rows[0], :5].tolist() + batch.req_to_token[rows[1], :4].tolist()
    assert slots.tolist() == want and starts.tolist() == [0, 5]


# ---- an FP8 latent pool -------------------------------------------------------------------


def _fp8_pool(batch, kv: torch.dtype, kv_scale: float) -> torch.Tensor:
    """The batch's fp32 pool (NaN where unowned) as an FP8 pool holding ``latent / kv_scale``."""
    return (batch.k_buffer.float() / kv_scale).to(kv)


FP8_DECODE = [
    pytest.param(20, 32, 16, 16, F32, E4M3, 1.0, [1, 37, 130, 64], None, id="e4m3-q32-auto"),
    pytest.param(16, 32, 16, 1, F16, E4M3, 0.05, [200, 5, 97], 4, id="e4m3-scaled-q16-4splits"),
    pytest.param(3, 16, 8, 16, F32, E5M2, 0.25, [45, 17], 3, id="e5m2-scaled-q32-tiny"),
    pytest.param(128, 512, 64, 16, BF16, E4M3, 1.0, [4096, 1, 1000, 33, 2500, 129], None,
                 id="v3-shape-e4m3-bf16", marks=GPU_MARKS),
]


@pytest.mark.parametrize("h,r,p,page,dtype,kv,kv_scale,lens,splits", FP8_DECODE)
def test_mla_decode_fp8_latent_matches_reference(h, r, p, page, dtype, kv, kv_scale, lens,
                                                 splits):
    batch = _latent_batch([n - 1 for n in lens], [1] * len(lens), r, p, page, F32, seed=13)
    pool = _fp8_pool(batch, kv, kv_scale)
    bs, scale = len(lens), 0.3
    q_lat, q_pe = randn((bs, h, r), dtype, 31), randn((bs, h, p), dtype, 32)
    ref = mla_attention_ref(torch.cat([q_lat, q_pe], -1).float(), pool, batch.req_to_token,
                            batch.req_pool_indices.tolist(), batch.seq_lens.tolist(),
                            [1] * bs, scale, r, kv_scale)
    if splits is None:
        cap = mla_split_cap(bs, h, num_sms=8, waves=1, max_kv_splits=16)
        num = choose_mla_splits(batch.seq_lens, h, cap, num_sms=8, min_chunk=16)
    else:
        cap, num = splits, torch.full((bs,), splits, dtype=torch.int32, device=DEVICE)
    o = torch.full((bs, h, r), float("nan"), dtype=dtype, device=DEVICE)
    mla_decode_fwd(q_lat, q_pe, pool, o, batch.req_to_token, batch.req_pool_indices,
                   batch.seq_lens, scale, num, cap, kv_scale=kv_scale)
    # the dots run in fp16 (the query rounded to it once): fp16's tolerance for fp32 queries
    assert_close(o, ref.to(dtype), F16 if dtype == F32 else dtype,
                 f"mla decode over a {kv} latent, kv_scale {kv_scale}")


def test_mla_decode_fp8_refuses_a_bad_scale():
    batch = _latent_batch([3], [1], 16, 16, 16, F32, seed=1)
    q = randn((1, 2, 16), F32, 1)
    with pytest.raises(ValueError, match="positive"):
        mla_decode_fwd(q, q.clone(), _fp8_pool(batch, E4M3, 1.0), q.clone(),
                       batch.req_to_token, batch.req_pool_indices, batch.seq_lens, 0.3,
                       torch.ones(1, dtype=torch.int32, device=DEVICE), 1, kv_scale=0.0)


@pytest.mark.parametrize("kv,kv_scale,dtype", [
    pytest.param(E4M3, 1.0, F32, id="e4m3-f32"),
    pytest.param(E4M3, 0.05, F16, id="e4m3-scaled-f16"),
])
def test_mla_prefill_over_fp8_latent_rows_matches_reference(kv, kv_scale, dtype):
    """The extend's rows gathered from an FP8 pool in the run dtype, decompressed, attended
    by the prefill kernel: the reference over the dequantized pool."""
    from engine.layers.mla import latent_rows

    h, n, p, v, r = 4, 16, 16, 24, 32
    prefix, extend = [0, 40, 17], [23, 9, 30]
    batch = _latent_batch(prefix, extend, r, p, 16, F32, seed=15)
    pool = _fp8_pool(batch, kv, kv_scale)
    t, scale = sum(extend), (n + p) ** -0.5
    q_nope, q_pe = randn((t, h, n), dtype, 41), randn((t, h, p), dtype, 42)
    w_uk = randn((h, n, r), F32, 43, scale=r ** -0.5).to(dtype)
    w_uv = randn((h, v, r), F32, 44, scale=r ** -0.5).to(dtype)
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float()),
                       q_pe.float()], -1)
    o_lat = mla_attention_ref(q_abs, pool, batch.req_to_token, batch.req_pool_indices.tolist(),
                              batch.seq_lens.tolist(), extend, scale, r, kv_scale)
    ref = torch.einsum("thr,hvr->thv", o_lat, w_uv.float())

    slots, kv_start = ragged_latent_slots(batch.req_to_token, batch.req_pool_indices,
                                          batch.seq_lens, int(batch.seq_lens.sum()))
    rows = latent_rows(pool, slots, dtype, kv_scale)
    assert rows.dtype == dtype and torch.isfinite(rows).all()
    k_nope = torch.einsum("sr,hnr->shn", rows[:, :r].float(), w_uk.float()).to(dtype)
    vals = torch.einsum("sr,hvr->shv", rows[:, :r].float(), w_uv.float()).to(dtype)
    ext = torch.tensor(extend, dtype=torch.int32, device=DEVICE)
    q_start = (torch.cumsum(ext, 0) - ext).to(torch.int32)
    o = torch.full((t, h, v), float("nan"), dtype=dtype, device=DEVICE)
    mla_prefill_fwd(q_nope, q_pe, k_nope, rows[:, r:], vals, o, batch.seq_lens, ext, q_start,
                    kv_start, scale, max(extend))
    assert_close(o, ref, dtype, f"mla prefill over {kv} rows")
