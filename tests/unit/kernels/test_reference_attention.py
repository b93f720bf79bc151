"""The torch reference kernels, and the torch_native attention backend built on them, against
torch's own scaled_dot_product_attention."""

import pytest
import torch
import torch.nn.functional as F

from engine.attention import TorchNativeAttnBackend
from engine.forward_batch import ForwardBatch, ForwardMode
from kernels.reference import (
    decode_attention_ref,
    decode_attention_sdpa,
    decode_plan,
    extend_attention_ref,
    extend_attention_sdpa,
    extend_plan,
    store_kv_ref,
)


def _sdpa(q, k, v, scale, causal_offset=None):
    """q [n, Hq, D], k/v [m, Hkv, D] -> [n, Hq, D] via F.scaled_dot_product_attention."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    mask = None
    if causal_offset is not None:
        n, m = q.shape[0], k.shape[0]
        mask = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + causal_offset
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k.transpose(0, 1).double(),
                                         v.transpose(0, 1).double(), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _pool(num_slots=300, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_slots, hkv, d, generator=g), torch.randn(num_slots, hkv, d, generator=g))


def test_decode_reference_matches_sdpa():
    kb, vb = _pool()
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, 13, 40, 7], dtype=torch.int32)
    r2t = torch.zeros(5, 64, dtype=torch.int32)
    perm = torch.randperm(299, generator=g) + 1
    r2t[1:] = perm[: 4 * 64].view(4, 64).to(torch.int32)
    rows = torch.tensor([1, 2, 3, 4])
    q = torch.randn(4, 6, 16, generator=g)
    o = torch.full_like(q, float("nan"))
    decode_attention_ref(q, kb, vb, o, r2t, rows, lens, 0.3)
    for b in range(4):
        slots = r2t[rows[b], : lens[b]].long()
        ref = _sdpa(q[b: b + 1], kb[slots], vb[slots], 0.3)[0]
        torch.testing.assert_close(o[b].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hkv,dtype,tol", [
    (6, 2, torch.float32, 1e-5),      # groups of 3 query heads per KV head
    (4, 4, torch.float32, 1e-5),      # no grouping
    (8, 1, torch.float32, 1e-5),      # multi-query
    (6, 2, torch.bfloat16, 2e-2),     # bf16 in and out, fp32 inside
])
def test_decode_sdpa_path_matches_per_request_float64(hq, hkv, dtype, tol):
    """The torch-native backend's decode path (groups as query positions, one fused call)
    against a float64 attention of each request over its own slots."""
    kb, vb = _pool(num_slots=400, hkv=hkv, seed=5)
    g = torch.Generator().manual_seed(6)
    lens = [1, 13, 40, 7, 64]
    r2t = torch.zeros(6, 64, dtype=torch.int32)
    r2t[1:] = (torch.randperm(399, generator=g) + 1)[: 5 * 64].view(5, 64).to(torch.int32)
    rows = torch.tensor([1, 2, 3, 4, 5])
    q = torch.randn(5, hq, 16, generator=g)
    kb, vb, q = kb.to(dtype), vb.to(dtype), q.to(dtype)
    plan = decode_plan(r2t, rows, torch.tensor(lens), max(lens))
    o = torch.full_like(q, float("nan"))
    decode_attention_sdpa(q, kb, vb, o, plan, 0.3)
    assert o.dtype == dtype
    for b, n in enumerate(lens):
        slots = r2t[rows[b], :n].long()
        ref = _sdpa(q[b: b + 1].double(), kb[slots].double(), vb[slots].double(), 0.3)[0]
        torch.testing.assert_close(o[b].double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("path", ["reference", "sdpa"])
def test_extend_reference_with_prefix_matches_sdpa(path):
    """extend_attention_ref and the backend's fused path (extend_attention_sdpa, with and
    without a cached prefix) against float64 attention per request."""
    kb, vb = _pool(seed=2)
    g = torch.Generator().manual_seed(3)
    prefix = [0, 5, 11]
    ext = [4, 1, 6]
    r2t = torch.zeros(4, 32, dtype=torch.int32)
    perm = (torch.randperm(299, generator=g) + 1)[: 3 * 32].view(3, 32).to(torch.int32)
    r2t[1:] = perm
    rows = torch.tensor([1, 2, 3])
    T = sum(ext)
    q = torch.randn(T, 6, 16, generator=g)
    k = torch.randn(T, 2, 16, generator=g)
    v = torch.randn(T, 2, 16, generator=g)
    starts = torch.tensor([0, 4, 5], dtype=torch.int32)
    seq = torch.tensor([p + e for p, e in zip(prefix, ext)], dtype=torch.int32)
    # the new tokens are stored in the pool first, as the attention layer does
    loc = torch.cat([r2t[rows[b], prefix[b]: prefix[b] + ext[b]] for b in range(3)]).long()
    store_kv_ref(kb, vb, loc, k, v)
    assert torch.equal(kb[loc], k)
    o = torch.full_like(q, float("nan"))
    if path == "reference":
        extend_attention_ref(q, k, v, o, kb, vb, r2t, rows, seq, torch.tensor(ext), starts,
                             0.25)
    else:
        plan = extend_plan(r2t, rows.tolist(), seq.tolist(), ext, starts.tolist())
        extend_attention_sdpa(q, k, v, o, kb, vb, plan, 0.25)
    for b in range(3):
        s0, n = int(starts[b]), ext[b]
        slots = r2t[rows[b], : prefix[b] + n].long()
        ref = _sdpa(q[s0: s0 + n], kb[slots], vb[slots], 0.25, causal_offset=prefix[b])
        torch.testing.assert_close(o[s0: s0 + n].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["mixed", "decode"])
def test_torch_native_backend_matches_sdpa(mode):
    """The backend's whole layer call: store the new K/V, extend attention for the extending
    requests, decode attention for the one-token tail (mixed step) or the whole DECODE step."""
    kb, vb = _pool(seed=4)
    g = torch.Generator().manual_seed(5)
    prefix, ext = ([3, 0, 9, 20], [5, 7, 1, 1]) if mode == "mixed" else ([4, 17, 30], [1, 1, 1])
    num_decodes = 2 if mode == "mixed" else 0
    b = len(prefix)
    r2t = torch.zeros(b + 1, 64, dtype=torch.int32)
    r2t[1:] = (torch.randperm(299, generator=g) + 1)[: b * 64].view(b, 64).to(torch.int32)
    rows = torch.arange(1, b + 1)
    t = sum(ext)
    q = torch.randn(t, 6, 16, generator=g)
    k = torch.randn(t, 2, 16, generator=g)
    v = torch.randn(t, 2, 16, generator=g)
    starts = [sum(ext[:i]) for i in range(b)]
    seq = torch.tensor([p + e for p, e in zip(prefix, ext)], dtype=torch.int32)
    loc = torch.cat([r2t[rows[i], prefix[i]: prefix[i] + ext[i]] for i in range(b)]).long()
    backend = TorchNativeAttnBackend(6, 2, 16)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND if mode == "mixed" else ForwardMode.DECODE, batch_size=b,
        positions=None, req_pool_indices=rows, seq_lens=seq, out_cache_loc=loc,
        req_to_token=r2t, k_buffers=[None, kb], v_buffers=[None, vb], attn_backend=backend,
        extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32), max_extend_len=max(ext),
        num_decodes=num_decodes)
    backend.init_forward(fb)
    out = backend.forward(q, k, v, 1, 0.3, fb)
    assert torch.equal(kb[loc], k) and torch.equal(vb[loc], v)
    for i in range(b):
        s0, n = starts[i], ext[i]
        slots = r2t[rows[i], : prefix[i] + n].long()
        ref = _sdpa(q[s0: s0 + n], kb[slots], vb[slots], 0.3, causal_offset=prefix[i])
        torch.testing.assert_close(out[s0: s0 + n].double(), ref, rtol=1e-5, atol=1e-5)


def test_backend_without_init_forward_refuses_decode():
    backend = TorchNativeAttnBackend(2, 1, 8)
    kb, vb = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    fb = ForwardBatch(mode=ForwardMode.DECODE, batch_size=1, positions=None,
                      req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([1]),
                      out_cache_loc=torch.tensor([1]), req_to_token=torch.ones(1, 4).int(),
                      k_buffers=[kb], v_buffers=[vb], attn_backend=backend)
    with pytest.raises(RuntimeError, match="init_forward"):
        backend.forward(torch.zeros(1, 2, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), 0,
                        1.0, fb)
