"""Extend attention with per-row key limits (``key_limit``: bidirectional spans, Gemma 3's
image tokens) in the Triton kernel (interpreter on the CPU, fp16/fp32), the torch reference
and the CPU path (``extend_plan`` + ``extend_attention_sdpa``), against a float64 dense
attention written from HF's Gemma 3 mask: key ``j`` visible to the query at ``p`` iff
``(j <= p or j, p in one span)`` and, with a window, ``p - W < j``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, assert_close, make_extend_inputs, nan_like, request_kv

from kernels.extend_attention import extend_attention_fwd
from kernels.reference import extend_attention_ref, extend_attention_sdpa, extend_plan

F16, F32 = torch.float16, torch.float32


def _limits(prefix_lens, extend_lens, spans):
    """key_limit [T] int32 from per-request spans (positions ``[a, b)``, each inside the
    request's new tokens), and the dense reference's visibility per request."""
    out = []
    for p, n, sp in zip(prefix_lens, extend_lens, spans):
        lim = list(range(1, n + 1))
        for a, b in sp:
            lim[a - p:b - p] = [b - p] * (b - a)
        out += lim
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def _dense(q, k, v, p, spans, scale, window):
    """float64 attention of one request's new queries (positions p..) over its keys."""
    n, m = q.shape[0], k.shape[0]
    hq, hkv = q.shape[1], k.shape[1]
    kf = k.double().cpu().repeat_interleave(hq // hkv, 1)
    vf = v.double().cpu().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("nhd,mhd->hnm", q.double().cpu(), kf) * scale
    qp = torch.arange(p, p + n)[:, None]
    kp = torch.arange(m)[None, :]
    same = torch.zeros(n, m, dtype=torch.bool)
    for a, b in spans:
        same |= (qp >= a) & (qp < b) & (kp >= a) & (kp < b)
    seen = (kp <= qp) | same
    if window is not None:
        seen &= kp > qp - window
    p_ = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
    return torch.einsum("hnm,mhd->nhd", p_, vf)


# (group, hkv, d, page, dtype, prefix_lens, extend_lens, spans per request, window)
CASES = [
    pytest.param(2, 2, 32, 1, F32, [0], [40], [[(5, 21)]], None, id="prefill-one-span-f32"),
    pytest.param(2, 1, 64, 16, F16, [0, 23], [50, 30], [[(3, 19), (25, 41)], [(30, 46)]],
                 None, id="two-requests-three-spans-p16-f16"),
    pytest.param(1, 2, 32, 16, F32, [17, 0], [45, 20], [[(20, 36)], []], 8,
                 id="window8-span16-p16-f32"),
    pytest.param(4, 1, 64, 1, F16, [40], [70], [[(40, 56), (58, 74)]], 12,
                 id="window12-chunk-starts-with-span-f16"),
    pytest.param(2, 2, 32, 16, F32, [5], [40], [[(5, 37)]], None,
                 id="span-across-query-blocks-f32"),
]


@pytest.mark.parametrize("group,hkv,d,page,dtype,prefix_lens,extend_lens,spans,window", CASES)
def test_key_limit_matches_dense(group, hkv, d, page, dtype, prefix_lens, extend_lens, spans,
                                 window):
    batch, q, k, v, ext, starts = make_extend_inputs(group, hkv, d, page, dtype, prefix_lens,
                                                     extend_lens, seed=sum(extend_lens) + d)
    lim = _limits(prefix_lens, extend_lens, spans)
    scale = d ** -0.5
    common = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
              batch.seq_lens, ext, starts, scale)
    ref = torch.empty_like(q)
    extend_attention_ref(q, k, v, ref, *common, sliding_window=window, key_limit=lim)
    o = nan_like(q)
    extend_attention_fwd(q, k, v, o, *common, max_extend_len=max(extend_lens),
                         sliding_window=window, key_limit=lim)
    plan = extend_plan(batch.req_to_token, batch.req_pool_indices.tolist(),
                       batch.seq_lens.tolist(), extend_lens, starts.tolist(), lim.tolist())
    cpu = torch.empty_like(q)
    extend_attention_sdpa(q, k, v, cpu, batch.k_buffer, batch.v_buffer, plan, scale,
                          sliding_window=window)
    for b, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        s0 = int(starts[b])
        kk, vv = request_kv(batch, b, k[s0:s0 + n], v[s0:s0 + n])
        dense = _dense(q[s0:s0 + n], kk, vv, p, spans[b], scale, window)
        torch.testing.assert_close(ref[s0:s0 + n].double().cpu(), dense, atol=2e-3, rtol=2e-3)
    assert_close(o, ref, dtype, "extend with key limits")
    assert_close(cpu, ref, dtype, "CPU path with key limits")
    # the spans matter: the plain causal kernel gives another result
    causal = nan_like(q)
    extend_attention_fwd(q, k, v, causal, *common, max_extend_len=max(extend_lens),
                         sliding_window=window)
    assert (causal.float() - o.float()).abs().max() > 1e-2


def test_causal_limits_are_the_plain_kernel():
    """key_limit = i + 1 everywhere is causal attention (the CPU plan keeps its fast path)."""
    batch, q, k, v, ext, starts = make_extend_inputs(2, 1, 32, 16, F32, [9, 0], [30, 17], 3)
    lim = _limits([9, 0], [30, 17], [[], []])
    common = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
              batch.seq_lens, ext, starts, 32 ** -0.5)
    a, b = nan_like(q), nan_like(q)
    extend_attention_fwd(q, k, v, a, *common, max_extend_len=30, key_limit=lim)
    extend_attention_fwd(q, k, v, b, *common, max_extend_len=30)
    torch.testing.assert_close(a, b)
    plan = extend_plan(batch.req_to_token, batch.req_pool_indices.tolist(),
                       batch.seq_lens.tolist(), [30, 17], starts.tolist(), lim.tolist())
    assert all(it.causal for it in plan)


def test_key_limit_shape_is_checked():
    batch, q, k, v, ext, starts = make_extend_inputs(1, 1, 32, 1, F32, [0], [8], 1)
    with pytest.raises(ValueError, match="key_limit"):
        extend_attention_fwd(q, k, v, nan_like(q), batch.k_buffer, batch.v_buffer,
                             batch.req_to_token, batch.req_pool_indices, batch.seq_lens, ext,
                             starts, 1.0, max_extend_len=8,
                             key_limit=torch.ones(8, dtype=torch.int64, device=DEVICE))
