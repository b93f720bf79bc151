"""The attention variants of the Triton decode and extend kernels (sliding window, logit
soft-cap, custom scale, per-head sinks) against a dense float64 masked softmax written in
the test (``kernel_test_utils.dense_attention``), not against the code's own reference.

Sizes are small: on the CPU the kernels run in Triton's interpreter, on 2 shared cores.
The interpreter's bf16 ``tl.dot`` is wrong, so the dtypes are fp16 and fp32. A windowed
call runs on a pool whose keys outside every query's window are NaN, so reading them (not
only masking them) fails the test: the decode splits cover the window alone.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import (
    DEVICE,
    GPU_MARKS,
    assert_close,
    backend_mixed_step,
    dense_attention,
    make_extend_inputs,
    make_paged_batch,
    nan_like,
    poison_outside_window,
    randn,
    request_kv,
)

from kernels.decode_attention import decode_attention_fwd
from kernels.extend_attention import extend_attention_fwd

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


def _sinks(hq: int, seed: int) -> torch.Tensor:
    return randn((hq,), F32, seed, scale=2.0)


# (group, hkv, d, page, dtype, seq_lens, splits, window, softcap, sinks, scale):
# windows below a page (5 < 16), above a page but below the prompt, above the prompt, and
# the one-key window; GQA (tl.dot path) and MHA (elementwise path); one and several splits.
DECODE = [
    pytest.param(4, 1, 32, 16, F16, [70, 9], [3, 2], 5, None, False, None, id="win5-p16-gqa"),
    pytest.param(1, 2, 32, 1, F32, [70, 33], [4, 1], 40, None, False, None, id="win40-p1-mha"),
    pytest.param(2, 1, 32, 16, F32, [50], [2], 200, None, False, None, id="win-over-prompt"),
    pytest.param(2, 1, 32, 1, F16, [37, 1], [2, 1], 1, None, False, None, id="win1"),
    pytest.param(4, 1, 32, 16, F16, [60, 21], [1, 1], None, 5.0, False, None, id="softcap"),
    pytest.param(1, 2, 32, 1, F32, [45], [1], None, None, False, 0.05, id="scale-mha"),
    pytest.param(4, 1, 32, 16, F32, [90, 5, 33], [5, 1, 3], None, None, True, None,
                 id="sinks-splits"),
    pytest.param(1, 2, 32, 1, F16, [64, 20], [4, 1], None, None, True, None,
                 id="sinks-splits-mha"),
    pytest.param(4, 2, 32, 1, F32, [80, 12], [3, 2], 24, 8.0, True, 0.3, id="all-gqa"),
    pytest.param(1, 2, 32, 16, F16, [75], [4], 20, 3.0, True, None, id="all-mha-p16"),
    pytest.param(4, 8, 128, 16, BF16, [3000, 700, 4097], [8, 2, 5], 1024, 30.0, True, None,
                 id="all-bf16-big", marks=GPU_MARKS),
]


@pytest.mark.parametrize("group,hkv,d,page,dtype,lens,splits,window,softcap,sinks,scale",
                         DECODE)
def test_decode_variants_match_dense(group, hkv, d, page, dtype, lens, splits, window,
                                     softcap, sinks, scale):
    batch = make_paged_batch(lens, None, num_kv_heads=hkv, head_dim=d, page_size=page,
                             dtype=dtype, seed=sum(lens) + d)
    hq = group * hkv
    q = randn((len(lens), hq, d), dtype, 5, scale=2.0)
    scale = scale or d ** -0.5
    sink_t = _sinks(hq, 6) if sinks else None
    ref = torch.stack([dense_attention(q[b:b + 1], *request_kv(batch, b), [n - 1], scale,
                                       window=window, softcap=softcap, sinks=sink_t)[0]
                       for b, n in enumerate(lens)])
    if window is not None:
        poison_outside_window(batch, window, [n - 1 for n in lens])
    o = nan_like(q)
    decode_attention_fwd(q, batch.k_buffer, batch.v_buffer, o, batch.req_to_token,
                         batch.req_pool_indices, batch.seq_lens, scale,
                         num_kv_splits=torch.tensor(splits, dtype=torch.int32, device=DEVICE),
                         max_kv_splits=8, sliding_window=window, logit_softcap=softcap,
                         sinks=sink_t)
    assert_close(o, ref, dtype, "decode variants")


def test_decode_sink_enters_once_whatever_the_splits():
    """The same request split 1, 2 and 7 ways gives the same output with a sink (a sink
    merged per split would weigh it 2 and 7 times)."""
    batch = make_paged_batch([100], None, num_kv_heads=1, head_dim=32, page_size=1,
                             dtype=F32, seed=3)
    q = randn((1, 4, 32), F32, 4)
    sinks = torch.full((4,), 3.0, device=DEVICE)   # large: a double count is visible
    outs = []
    for n in (1, 2, 7):
        o = nan_like(q)
        decode_attention_fwd(q, batch.k_buffer, batch.v_buffer, o, batch.req_to_token,
                             batch.req_pool_indices, batch.seq_lens, 32 ** -0.5,
                             num_kv_splits=torch.tensor([n], dtype=torch.int32, device=DEVICE),
                             max_kv_splits=8, sinks=sinks)
        outs.append(o)
    ref = dense_attention(q, *request_kv(batch, 0), [99], 32 ** -0.5, sinks=sinks)
    for o in outs:
        assert_close(o, ref, F32, "decode sink")


def test_decode_rejects_bad_variants():
    batch = make_paged_batch([10], None, num_kv_heads=1, head_dim=32, page_size=1, dtype=F32,
                             seed=1)
    q = randn((1, 2, 32), F32, 2)
    args = (q, batch.k_buffer, batch.v_buffer, nan_like(q), batch.req_to_token,
            batch.req_pool_indices, batch.seq_lens, 0.2)
    for bad in ({"sliding_window": 0}, {"logit_softcap": 0.0},
                {"sinks": torch.zeros(3, device=DEVICE)},
                {"sinks": torch.zeros(2, dtype=F16, device=DEVICE)}):
        with pytest.raises(ValueError):
            decode_attention_fwd(*args, num_sms=4, **bad)


# (group, hkv, d, page, dtype, prefix_lens, extend_lens, window, softcap, sinks, scale,
# blocks): windows below a page, below the 16/64-row blocks, across a prefix (a chunked
# prefill whose prefix is longer than the window), above the whole prompt.
EXTEND = [
    pytest.param(2, 1, 32, 16, F16, [0, 0], [70, 9], 5, None, False, None, None,
                 id="win5-prefill-p16"),
    pytest.param(2, 1, 32, 1, F32, [50, 3], [30, 20], 12, None, False, None, None,
                 id="win12-prefix-crosses-p1"),
    pytest.param(1, 2, 32, 16, F16, [40], [50], 25, None, False, None, None,
                 id="win25-chunk-mha-p16"),
    pytest.param(2, 1, 32, 16, F32, [10], [20], 500, None, False, None, None,
                 id="win-over-prompt"),
    pytest.param(2, 1, 32, 1, F16, [7, 0], [40, 3], 1, None, False, None, None, id="win1"),
    pytest.param(2, 1, 32, 16, F16, [20], [45], 30, None, False, None, (32, 16),
                 id="win30-blocks32x16"),
    pytest.param(2, 1, 32, 16, F16, [20, 0], [30, 17], None, 5.0, False, 0.1, None,
                 id="softcap-scale"),
    pytest.param(4, 1, 32, 1, F32, [33, 0], [17, 25], None, None, True, None, None,
                 id="sinks"),
    pytest.param(2, 2, 32, 16, F16, [60, 5], [40, 20], 18, 8.0, True, 0.3, None,
                 id="all-chunked"),
    pytest.param(4, 8, 128, 16, BF16, [1500, 0], [700, 300], 512, 50.0, True, None, None,
                 id="all-bf16-big", marks=GPU_MARKS),
]


@pytest.mark.parametrize(
    "group,hkv,d,page,dtype,prefix_lens,extend_lens,window,softcap,sinks,scale,blocks", EXTEND)
def test_extend_variants_match_dense(group, hkv, d, page, dtype, prefix_lens, extend_lens,
                                     window, softcap, sinks, scale, blocks):
    batch, q, k, v, ext, starts = make_extend_inputs(group, hkv, d, page, dtype, prefix_lens,
                                                     extend_lens, seed=sum(extend_lens))
    hq = group * hkv
    scale = scale or d ** -0.5
    sink_t = _sinks(hq, 7) if sinks else None
    refs = []
    for b, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        s0 = int(starts[b])
        kk, vv = request_kv(batch, b, k[s0:s0 + n], v[s0:s0 + n])
        refs.append(dense_attention(q[s0:s0 + n], kk, vv, list(range(p, p + n)), scale,
                                    window=window, softcap=softcap, sinks=sink_t))
    ref = torch.cat(refs)
    if window is not None:
        poison_outside_window(batch, window, prefix_lens)
    o = nan_like(q)
    bm, bn = blocks or (None, None)
    extend_attention_fwd(q, k, v, o, batch.k_buffer, batch.v_buffer, batch.req_to_token,
                         batch.req_pool_indices, batch.seq_lens, ext, starts, scale,
                         max_extend_len=max(extend_lens), block_m=bm, block_n=bn,
                         sliding_window=window, logit_softcap=softcap, sinks=sink_t)
    assert_close(o, ref, dtype, "extend variants")


def test_triton_backend_passes_the_variants():
    """``AttentionBackend.forward`` with the variants on a mixed step: the extend kernel for
    the chunk (prefix across the window) and the prefill, the decode kernel for the tail."""
    sinks = randn((4,), F32, 8, scale=2.0)
    out, ref = backend_mixed_step("triton", F16, 0.2, sliding_window=16, logit_softcap=5.0,
                                  sinks=sinks)
    assert_close(out, ref, F16, "triton backend mixed step")
