"""The attention backends on a mixed step (a prefill chunk plus running decodes).

Each backend runs the extending requests with the extend kernel and the ``num_decodes``
one-token tail with the decode kernel. The reference is ``extend_attention_ref`` over the
whole batch (every request an extend), so a wrong split point, slice or workspace shows up
as a mismatch. Both the Triton backend (interpreter on the CPU) and the torch_native backend
are checked; the torch_native kernels are checked against SDPA in
tests/unit/kernels/test_reference_attention.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import GPU_MARKS, assert_close, make_extend_inputs

from engine.attention import ATTENTION_BACKENDS, TritonMetadata
from engine.forward_batch import ForwardBatch, ForwardMode
from kernels.reference import extend_attention_ref

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16

CASES = [
    # (group, hkv, d, page, dtype, extend prefixes, extend lens, decode prefixes)
    pytest.param(4, 2, 64, 1, F32, [0], [40], [17, 90, 3], id="prefill+3dec-f32"),
    pytest.param(3, 1, 64, 16, F16, [33, 0], [20, 9], [200, 1, 64, 15], id="2ext+4dec-p16-f16"),
    pytest.param(2, 2, 128, 1, F16, [5], [1], [7], id="ext1+dec1-f16"),
    pytest.param(4, 8, 128, 16, BF16, [0, 700], [1500, 300], [600] * 36,
                 id="chunk+36dec-bf16", marks=GPU_MARKS),
]


def _mixed(group, hkv, d, page, dtype, ext_prefix, ext_lens, dec_prefix, seed):
    prefix = ext_prefix + dec_prefix
    extend = ext_lens + [1] * len(dec_prefix)
    batch, q, k, v, ext, starts = make_extend_inputs(group, hkv, d, page, dtype, prefix,
                                                     extend, seed)
    # the new tokens' slots, in batch order, as the scheduler allocates them
    loc = torch.cat([batch.req_to_token[r, p:p + n].long()
                     for r, p, n in zip(batch.req_pool_indices.tolist(), prefix, extend)])
    return batch, q, k, v, ext, starts, loc, extend


def _backend(name, group, hkv, d, device="cpu"):
    return ATTENTION_BACKENDS[name](group * hkv, hkv, d, num_sms=8, device=device)


@pytest.mark.parametrize("name", ["triton", "torch_native"])
@pytest.mark.parametrize("group,hkv,d,page,dtype,ext_prefix,ext_lens,dec_prefix", CASES)
def test_mixed_step_matches_one_extend(name, group, hkv, d, page, dtype, ext_prefix,
                                       ext_lens, dec_prefix):
    if dtype == BF16 and name != "triton":
        pytest.skip("the torch path is checked in fp16/fp32")
    seed = sum(ext_lens) + len(dec_prefix)
    batch, q, k, v, ext, starts, loc, extend = _mixed(group, hkv, d, page, dtype, ext_prefix,
                                                      ext_lens, dec_prefix, seed)
    scale = d ** -0.5
    ref = torch.empty_like(q)
    extend_attention_ref(q, k, v, ref, batch.k_buffer, batch.v_buffer, batch.req_to_token,
                         batch.req_pool_indices, batch.seq_lens, ext, starts, scale)

    backend = _backend(name, group, hkv, d)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, batch_size=len(extend), positions=None,
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, out_cache_loc=loc,
        req_to_token=batch.req_to_token, k_buffers=[batch.k_buffer],
        v_buffers=[batch.v_buffer], attn_backend=backend, extend_seq_lens=ext,
        extend_start_loc=starts, max_extend_len=max(extend), num_decodes=len(dec_prefix))
    backend.init_forward(fb)
    m = fb.attn_meta
    ne = len(ext_lens)
    assert fb.num_extends == ne and m.num_decodes == len(dec_prefix)
    assert torch.equal(m.req_pool_indices, batch.req_pool_indices[ne:])
    assert torch.equal(m.seq_lens, batch.seq_lens[ne:])
    if name == "triton":
        assert isinstance(m, TritonMetadata) and m.num_kv_splits.shape == (len(dec_prefix),)
        # the decode tail's rows are fresh copies (aligned whatever the split point)
        assert m.req_pool_indices.data_ptr() % 16 == 0 and m.seq_lens.data_ptr() % 16 == 0
    out = backend.forward(q, k, v, 0, scale, fb)
    assert_close(out, ref, dtype, "mixed step")
    # the store wrote the new tokens into their slots
    assert torch.equal(batch.k_buffer[loc], k.to(batch.k_buffer.dtype))


def test_decode_step_uses_step_workspaces():
    """A DECODE step: split counts and workspaces come from init_forward, once per step."""
    group, hkv, d, dtype = 4, 2, 64, F32
    prefix = [100, 5, 40]
    batch, q, k, v, ext, starts, loc, _ = _mixed(group, hkv, d, 1, dtype, [], [], prefix, 7)
    ref = torch.empty_like(q)
    extend_attention_ref(q, k, v, ref, batch.k_buffer, batch.v_buffer, batch.req_to_token,
                         batch.req_pool_indices, batch.seq_lens, ext, starts, d ** -0.5)
    backend = _backend("triton", group, hkv, d)
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, batch_size=3, positions=None,
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, out_cache_loc=loc,
        req_to_token=batch.req_to_token, k_buffers=[batch.k_buffer],
        v_buffers=[batch.v_buffer], attn_backend=backend)
    backend.init_forward(fb)
    assert fb.attn_meta.attn_logits.shape == (3, group * hkv, backend.max_kv_splits, d)
    out = backend.forward(q, k, v, 0, d ** -0.5, fb)
    assert_close(out, ref, dtype, "decode step")


@pytest.mark.parametrize("name", [
    pytest.param("triton", marks=GPU_MARKS),  # the interpreter's fp8 cast is wrong
    "torch_native"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_mixed_step_with_fp8_kv_cache(name, kv_dtype):
    """--kv-cache-dtype fp8: the pool holds fp8 and the kernels upcast what they read; the new
    tokens of an extend are attended to as stored (rounded to fp8), like the prefix. So the
    reference is the model-dtype computation over fp8-rounded keys and values."""
    group, hkv, d = 4, 2, 64
    batch, q, k, v, ext, starts, loc, extend = _mixed(group, hkv, d, 1, F16, [30], [25],
                                                      [50, 7, 120], 11)
    batch.k_buffer[0] /= 10   # page 0 garbage must fit the fp8 range
    batch.v_buffer[0] /= 10
    kb, vb = batch.k_buffer.to(kv_dtype), batch.v_buffer.to(kv_dtype)
    ref = torch.empty_like(q)
    extend_attention_ref(q, k.to(kv_dtype).to(F16), v.to(kv_dtype).to(F16), ref, kb, vb,
                         batch.req_to_token, batch.req_pool_indices, batch.seq_lens, ext,
                         starts, d ** -0.5)
    backend = _backend(name, group, hkv, d)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, batch_size=len(extend), positions=None,
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, out_cache_loc=loc,
        req_to_token=batch.req_to_token, k_buffers=[kb], v_buffers=[vb], attn_backend=backend,
        extend_seq_lens=ext, extend_start_loc=starts, max_extend_len=max(extend), num_decodes=3)
    backend.init_forward(fb)
    out = backend.forward(q, k, v, 0, d ** -0.5, fb)
    assert_close(out, ref, F16, "mixed step, fp8 cache")
    # the new tokens went into the pool as fp8
    assert kb.dtype == kv_dtype and (kb[loc].float() != 0).any()


def test_decode_graph_metadata_lives_in_static_buffers():
    """init_capture + init_forward_graph (what the decode graph runner captures): the split
    counts are written into the static buffer, the workspaces are its slices, and the
    result is the reference's."""
    group, hkv, d, dtype = 2, 2, 64, F32
    prefix = [30, 3, 77]
    batch, q, k, v, ext, starts, loc, _ = _mixed(group, hkv, d, 1, dtype, [], [], prefix, 5)
    ref = torch.empty_like(q)
    extend_attention_ref(q, k, v, ref, batch.k_buffer, batch.v_buffer, batch.req_to_token,
                         batch.req_pool_indices, batch.seq_lens, ext, starts, d ** -0.5)
    backend = _backend("triton", group, hkv, d, device=q.device)  # static buffers live there
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, batch_size=3, positions=None,
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, out_cache_loc=loc,
        req_to_token=batch.req_to_token, k_buffers=[batch.k_buffer],
        v_buffers=[batch.v_buffer], attn_backend=backend)
    with pytest.raises(RuntimeError, match="init_capture"):
        backend.init_forward_graph(fb)
    backend.init_capture(max_bs=8)
    static_splits, static_logits, _ = backend._graph_bufs
    backend.init_forward_graph(fb)
    m = fb.attn_meta
    assert m.num_kv_splits.data_ptr() == static_splits.data_ptr()
    assert m.attn_logits.data_ptr() == static_logits.data_ptr()
    assert m.req_pool_indices is fb.req_pool_indices and m.seq_lens is fb.seq_lens
    # the same counts as an eager step computes (30 // 64 -> 1 split at least, ...)
    from kernels.decode_attention import choose_num_kv_splits

    want = choose_num_kv_splits(batch.seq_lens, hkv, backend.max_kv_splits, 8)
    assert torch.equal(static_splits[:3], want)
    out = backend.forward(q, k, v, 0, d ** -0.5, fb)
    assert_close(out, ref, dtype, "decode step, graph metadata")
