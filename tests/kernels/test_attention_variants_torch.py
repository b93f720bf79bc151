"""The attention variants (sliding window, logit soft-cap, custom scale, per-head sinks) of
the torch references (``kernels/reference.py``: the plain, planned and SDPA paths), of the
C++ CPU decode kernel (``kernels/cpu_ops.py``) and of both attention backends' layer call,
against the dense float64 masked softmax of ``kernel_test_utils.dense_attention``."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from kernel_test_utils import (
    DEVICE,
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

from kernels import cpu_ops
from kernels.reference import (
    decode_attention_ref,
    decode_attention_sdpa,
    decode_plan,
    extend_attention_ref,
    extend_attention_sdpa,
    extend_plan,
)

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
CPU_KERNELS = DEVICE == "cpu" and os.environ.get("FERRY_CPU_KERNELS") != "0" \
    and (shutil.which("g++") or shutil.which("c++")) is not None

# (window, softcap, sinks, scale): each variant alone, and all of them at once
VARIANTS = [
    pytest.param(5, None, False, None, id="win5"),           # below a 16-token page
    pytest.param(40, None, False, None, id="win40"),         # above a page, below the prompt
    pytest.param(1000, None, False, None, id="win-over-prompt"),
    pytest.param(1, None, False, None, id="win1"),
    pytest.param(None, 4.0, False, None, id="softcap"),
    pytest.param(None, None, True, None, id="sinks"),
    pytest.param(None, None, False, 0.07, id="scale"),
    pytest.param(24, 6.0, True, 0.3, id="all"),
]


def _decode_case(dtype, page=16, lens=(70, 9, 33), group=3, hkv=2, d=32):
    batch = make_paged_batch(list(lens), None, num_kv_heads=hkv, head_dim=d, page_size=page,
                             dtype=dtype, seed=sum(lens))
    q = randn((len(lens), group * hkv, d), dtype, 3, scale=2.0)
    return batch, q


def _decode_ref(batch, q, scale, window, softcap, sinks):
    return torch.stack([dense_attention(q[b:b + 1], *request_kv(batch, b), [n - 1], scale,
                                        window=window, softcap=softcap, sinks=sinks)[0]
                        for b, n in enumerate(batch.seq_lens.tolist())])


def _kw(hq, window, softcap, sinks):
    return {"sliding_window": window, "logit_softcap": softcap,
            "sinks": randn((hq,), F32, 9, scale=2.0) if sinks else None}


@pytest.mark.parametrize("window,softcap,sinks,scale", VARIANTS)
@pytest.mark.parametrize("path", ["ref", "sdpa", "cpu_ops-f32", "cpu_ops-bf16"])
def test_decode_variants_match_dense(path, window, softcap, sinks, scale):
    dtype = BF16 if path.endswith("bf16") else F32
    if path.startswith("cpu_ops") and not CPU_KERNELS:
        pytest.skip("ferry's C++ CPU kernels are not built here")
    batch, q = _decode_case(dtype, page=1 if path == "sdpa" else 16)
    hq, d = q.shape[1], q.shape[2]
    scale = scale or d ** -0.5
    kw = _kw(hq, window, softcap, sinks)
    ref = _decode_ref(batch, q, scale, window, softcap, kw["sinks"])
    o = nan_like(q)
    args = (q, batch.k_buffer, batch.v_buffer, o)
    if path == "ref":
        decode_attention_ref(*args, batch.req_to_token, batch.req_pool_indices,
                             batch.seq_lens, scale, **kw)
    elif path == "sdpa":
        plan = decode_plan(batch.req_to_token, batch.req_pool_indices, batch.seq_lens)
        decode_attention_sdpa(*args, plan, scale, **kw)
    else:
        cpu_ops.load()
        cpu_ops.decode_attention(*args, batch.req_to_token, batch.req_pool_indices,
                                 batch.seq_lens.long(), scale, **kw)
    assert_close(o, ref, dtype, f"decode {path}")


@pytest.mark.skipif(not CPU_KERNELS, reason="ferry's C++ CPU kernels are not built here")
@pytest.mark.parametrize("bf16_dot", ["0", "1"])
def test_cpu_decode_window_reads_only_the_window(bf16_dot, monkeypatch):
    """The C++ kernel with a window on a pool whose keys outside it are NaN (whole-request
    and per-head tasks, the bf16 dot task or the grouped fp32 one)."""
    monkeypatch.setenv("FERRY_CPU_BF16_DOT", bf16_dot)
    for lens in ([90, 40, 17], [60] * 12):
        batch, q = _decode_case(BF16, lens=lens, group=2, hkv=2, d=64)
        ref = _decode_ref(batch, q, 0.125, 20, None, None)
        poison_outside_window(batch, 20, [n - 1 for n in lens])
        o = nan_like(q)
        cpu_ops.load()
        cpu_ops.decode_attention(q, batch.k_buffer, batch.v_buffer, o, batch.req_to_token,
                                 batch.req_pool_indices, batch.seq_lens.long(), 0.125,
                                 sliding_window=20)
        assert_close(o, ref, BF16, f"cpu decode window, B={len(lens)}")


@pytest.mark.parametrize("window,softcap,sinks,scale", VARIANTS)
@pytest.mark.parametrize("path", ["ref", "sdpa"])
def test_extend_variants_match_dense(path, window, softcap, sinks, scale):
    # a chunked prefill whose prefix (50) is longer than the smaller windows, a plain
    # prefill, and a request that only appends one token
    prefix_lens, extend_lens = [50, 0, 12], [30, 45, 1]
    batch, q, k, v, ext, starts = make_extend_inputs(3, 2, 32, 16, F32, prefix_lens,
                                                     extend_lens, seed=5)
    scale = scale or 32 ** -0.5
    kw = _kw(q.shape[1], window, softcap, sinks)
    refs = []
    for b, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        s0 = int(starts[b])
        kk, vv = request_kv(batch, b, k[s0:s0 + n], v[s0:s0 + n])
        refs.append(dense_attention(q[s0:s0 + n], kk, vv, list(range(p, p + n)), scale,
                                    window=window, softcap=softcap, sinks=kw["sinks"]))
    o = nan_like(q)
    if path == "ref":
        extend_attention_ref(q, k, v, o, batch.k_buffer, batch.v_buffer, batch.req_to_token,
                             batch.req_pool_indices, batch.seq_lens, ext, starts, scale, **kw)
    else:
        plan = extend_plan(batch.req_to_token, batch.req_pool_indices.tolist(),
                           batch.seq_lens.tolist(), extend_lens, starts.tolist())
        extend_attention_sdpa(q, k, v, o, batch.k_buffer, batch.v_buffer, plan, scale, **kw)
    assert_close(o, torch.cat(refs), F32, f"extend {path}")


def test_references_reject_bad_variants():
    batch, q = _decode_case(F32)
    args = (q, batch.k_buffer, batch.v_buffer, nan_like(q), batch.req_to_token,
            batch.req_pool_indices, batch.seq_lens, 0.2)
    for bad in ({"sliding_window": 0}, {"logit_softcap": -1.0},
                {"sinks": torch.zeros(q.shape[1] + 1)}):
        with pytest.raises(ValueError):
            decode_attention_ref(*args, **bad)


@pytest.mark.parametrize("window,softcap,sinks", [(10, None, False), (None, 5.0, True),
                                                  (16, 5.0, True)])
def test_torch_native_backend_variants(window, softcap, sinks):
    """The CPU path end to end: store, extend (SDPA or planned), decode (the C++ kernel
    where it builds) with the variants passed to ``AttentionBackend.forward``."""
    out, ref = backend_mixed_step("torch_native", F32, 0.2, **_kw(4, window, softcap, sinks))
    assert_close(out, ref, F32, "torch_native mixed step")
