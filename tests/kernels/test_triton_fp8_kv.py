"""The FP8 KV cache paths of the Triton kernels (``KV_FP8``) against the torch references.

The pools hold float8_e4m3fn / float8_e5m2 with per-tensor scales != 1; the reference is the
fp32 computation over the dequantised pool (``pool.float() * scale``). Decode and extend
run their fp16 dots on fp16 or fp32 queries (bf16 ``tl.dot`` is garbage in the
interpreter); the unused pool slots are NaN in FP8 too, so a stray read still shows. The
windows, the soft-cap and the sinks keep working over an FP8 pool.

Rounding: Triton's interpreter rounds fp32 -> fp8 differently from torch (the GPU rounds to
nearest even, as torch does), so the extend test's reference takes the new tokens as
:func:`kernels.kv_store.store_kv` stored them, and the store test uses values that need no
rounding (rounding is compared with torch on a GPU: ``test_store_kv_fp8_matches_torch_on_gpu``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import (
    DEVICE,
    TOL,
    assert_close,
    gpu_only,
    make_extend_inputs,
    make_paged_batch,
    nan_like,
    randn,
)

from engine import device as devlib
from kernels.decode_attention import decode_attention_fwd
from kernels.extend_attention import extend_attention_fwd
from kernels.kv_store import store_kv
from kernels.reference import decode_attention_ref, extend_attention_ref, store_kv_ref

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
K_SCALE, V_SCALE = 0.0123, 0.0371     # the pool holds k / K_SCALE: values up to ~300


def _quantise(buf: torch.Tensor, scale: float, kv: torch.dtype) -> torch.Tensor:
    """A fp32 pool (NaN where unowned) as an FP8 pool holding ``buf / scale``."""
    return (buf.float() / scale).to(kv)


def _dequant(buf: torch.Tensor, scale: float) -> torch.Tensor:
    return buf.float() * scale


VARIANTS = [
    pytest.param({}, id="plain"),
    pytest.param({"sliding_window": 37}, id="window"),
    pytest.param({"logit_softcap": 5.0}, id="softcap"),
    pytest.param({"sinks": True}, id="sinks"),
]


def _variants(var: dict, hq: int, seed: int) -> dict:
    if var.get("sinks"):
        return {"sinks": randn((hq,), F32, seed)}
    return dict(var)


@pytest.mark.parametrize("kv", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("qdtype", [F16, F32], ids=["q16", "q32"])
@pytest.mark.parametrize("group,hkv,d,lens,splits", [
    pytest.param(4, 2, 64, [1, 77, 300], 1, id="gqa4-1split"),
    pytest.param(4, 2, 64, [200, 5], 3, id="gqa4-3splits"),
    pytest.param(1, 2, 64, [90, 130], 2, id="mha"),
])
@pytest.mark.parametrize("var", VARIANTS)
def test_decode_fp8_pool_with_scales(kv, qdtype, group, hkv, d, lens, splits, var):
    batch = make_paged_batch(lens, None, num_kv_heads=hkv, head_dim=d, page_size=16,
                             dtype=F32, seed=len(lens) + d)
    batch.k_buffer[:16] /= 100     # page 0's garbage must fit the FP8 range
    batch.v_buffer[:16] /= 100
    kb, vb = _quantise(batch.k_buffer, K_SCALE, kv), _quantise(batch.v_buffer, V_SCALE, kv)
    hq = group * hkv
    q = randn((len(lens), hq, d), qdtype, 3, scale=2.0)
    variants = _variants(var, hq, 4)
    ref = torch.empty_like(q, dtype=F32)
    decode_attention_ref(q.float(), _dequant(kb, K_SCALE), _dequant(vb, V_SCALE), ref,
                         batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                         d ** -0.5, **variants)
    o = nan_like(q)
    n_splits = torch.full((len(lens),), splits, dtype=torch.int32, device=q.device)
    decode_attention_fwd(q, kb, vb, o, batch.req_to_token, batch.req_pool_indices,
                         batch.seq_lens, d ** -0.5, num_kv_splits=n_splits, max_kv_splits=4,
                         k_scale=K_SCALE, v_scale=V_SCALE, **variants)
    # the dots run in fp16 whatever q's dtype: fp16's tolerance
    assert_close(o, ref, F16, f"decode, {kv} pool, {var}")


@pytest.mark.parametrize("kv", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("qdtype", [F16, F32], ids=["q16", "q32"])
@pytest.mark.parametrize("var", VARIANTS)
def test_extend_fp8_pool_with_scales(kv, qdtype, var):
    group, hkv, d = 2, 2, 64
    prefix, ext_lens = [40, 0, 70], [30, 65, 1]
    batch, q, k, v, ext, starts = make_extend_inputs(group, hkv, d, 16, F32, prefix, ext_lens,
                                                     seed=7)
    batch.k_buffer[:16] /= 100
    batch.v_buffer[:16] /= 100
    q = (q * 2).to(qdtype)
    k, v = k.to(qdtype), (v * 3).to(qdtype)   # |k| / K_SCALE inside e4m3's 448
    kb, vb = _quantise(batch.k_buffer, K_SCALE, kv), _quantise(batch.v_buffer, V_SCALE, kv)
    # the new tokens as the store kernel writes them (the engine stores them before it
    # attends); the extend kernel must attend to exactly these values
    loc = torch.cat([batch.req_to_token[r, p:p + n].long() for r, p, n in
                     zip(batch.req_pool_indices.tolist(), prefix, ext_lens)])
    store_kv(kb, vb, loc, k, v, K_SCALE, V_SCALE)
    hq = group * hkv
    variants = _variants(var, hq, 5)
    ref = torch.empty_like(q, dtype=F32)
    extend_attention_ref(q.float(), _dequant(kb[loc], K_SCALE), _dequant(vb[loc], V_SCALE),
                         ref, _dequant(kb, K_SCALE), _dequant(vb, V_SCALE),
                         batch.req_to_token, batch.req_pool_indices, batch.seq_lens, ext,
                         starts, d ** -0.5, **variants)
    o = nan_like(q)
    extend_attention_fwd(q, k, v, o, kb, vb, batch.req_to_token, batch.req_pool_indices,
                         batch.seq_lens, ext, starts, d ** -0.5, max_extend_len=max(ext_lens),
                         k_scale=K_SCALE, v_scale=V_SCALE, **variants)
    assert_close(o, ref, F16, f"extend, {kv} pool, {var}")


@pytest.mark.parametrize("kv", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_store_kv_fp8_quantises_with_scales(kv):
    """K and V in one program, ``x / scale`` quantised in registers, into the given slots
    only. The values are FP8 numbers times power-of-two scales, so the division is exact and
    no rounding happens: the interpreter's fp32 -> fp8 cast mis-rounds near powers of two
    (124 -> 64), so rounding itself is checked on a GPU."""
    t, hkv, d = 9, 3, 64
    ks, vs = 2.0 ** -6, 2.0 ** -3
    k = (randn((t, hkv, d), F32, 1, scale=40.0).to(kv).float() * ks).to(F16)
    v = randn((t, hkv, d), F32, 2, scale=40.0).to(kv).float() * vs
    loc = torch.tensor([5, 2, 17, 9, 11, 3, 14, 6, 1], dtype=torch.int64, device=k.device)
    kb = torch.zeros((20, hkv, d), dtype=kv, device=k.device)
    vb, kr, vr = kb.clone(), kb.clone(), kb.clone()
    store_kv(kb, vb, loc, k, v, ks, vs)
    store_kv_ref(kr, vr, loc, k, v, ks, vs)
    assert torch.equal(kb.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vb.view(torch.uint8), vr.view(torch.uint8))
    assert (kb[loc].float() != 0).any() and (kb[[0, 4]].float() == 0).all()


def test_store_kv_fp8_rejects_bad_scale():
    kb = torch.zeros((4, 1, 16), dtype=E4M3, device=DEVICE)
    x = torch.ones((1, 1, 16), device=DEVICE)
    with pytest.raises(ValueError, match="positive"):
        store_kv(kb, kb.clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE), x, x, 0.0)


@gpu_only
@pytest.mark.parametrize("kv", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_store_kv_fp8_matches_torch_on_gpu(kv):
    if not devlib.triton_fp8_e4m3(DEVICE):
        pytest.skip("Triton has no FP8 on this device")
    t, hkv, d = 300, 8, 128
    k, v = randn((t, hkv, d), BF16, 1), randn((t, hkv, d), BF16, 2, scale=3.0)
    loc = torch.randperm(t, device=k.device)
    kb = torch.zeros((t, hkv, d), dtype=kv, device=k.device)
    vb, kr, vr = kb.clone(), kb.clone(), kb.clone()
    store_kv(kb, vb, loc, k, v, K_SCALE, V_SCALE)
    store_kv_ref(kr, vr, loc, k, v, K_SCALE, V_SCALE)
    assert torch.equal(kb.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vb.view(torch.uint8), vr.view(torch.uint8))


@gpu_only
@pytest.mark.parametrize("kv", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("lens", [[2048] * 8, [8192, 1, 513]], ids=["bs8-2k", "ragged-8k"])
def test_decode_fp8_bf16_queries_on_gpu(kv, lens):
    """The engine's case: bf16 queries, Llama-3-8B head layout (GQA 4, D 128), auto splits."""
    if not devlib.triton_fp8_e4m3(DEVICE):
        pytest.skip("Triton has no FP8 on this device")
    group, hkv, d = 4, 8, 128
    batch = make_paged_batch(lens, None, num_kv_heads=hkv, head_dim=d, page_size=16,
                             dtype=F32, seed=3)
    batch.k_buffer[:16] /= 100
    batch.v_buffer[:16] /= 100
    kb, vb = _quantise(batch.k_buffer, K_SCALE, kv), _quantise(batch.v_buffer, V_SCALE, kv)
    q = randn((len(lens), group * hkv, d), BF16, 3, scale=2.0)
    ref = torch.empty_like(q, dtype=F32)
    decode_attention_ref(q.float(), _dequant(kb, K_SCALE), _dequant(vb, V_SCALE), ref,
                         batch.req_to_token, batch.req_pool_indices, batch.seq_lens, d ** -0.5)
    o = nan_like(q)
    decode_attention_fwd(q, kb, vb, o, batch.req_to_token, batch.req_pool_indices,
                         batch.seq_lens, d ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE,
                         num_sms=devlib.multiprocessor_count(q.device.type))
    assert_close(o, ref, BF16, "decode, bf16 q, FP8 pool")
    assert TOL[BF16] > TOL[F16]
