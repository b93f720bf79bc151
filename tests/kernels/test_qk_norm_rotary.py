"""``kernels.rotary.qk_norm_rotary_inplace`` (Qwen3's per-head q/k RMSNorm, or Gemma's
``(1 + w)`` form, and the rotary in one launch) against the eager chain it replaces:
``kernels.reference.rms_norm_ref`` / ``gemma_rms_norm_ref`` over each head, then
``kernels.reference.rotary_ref``; and ``RotaryEmbedding.norm_rotate``'s choice of when it
applies (interpreter on the CPU, compiled on GPUs)."""

import pytest
import torch
from kernel_test_utils import DEVICE

from engine.layers import rotary as rotary_mod
from engine.layers import select_ops
from engine.layers.norm import GemmaRMSNorm, RMSNorm
from engine.layers.rotary import RotaryEmbedding
from kernels.reference import gemma_rms_norm_ref, rms_norm_ref, rotary_ref
from kernels.rotary import qk_norm_rotary_inplace


def _qkv(t, hq, hk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=g) * 3).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return qkv, q, k, v


def _chain(q, k, qw, kw, eps, pos, cache, d, zero_centred):
    norm = gemma_rms_norm_ref if zero_centred else rms_norm_ref
    t = q.shape[0]
    qn = norm(q.reshape(t, -1, d), qw, eps).reshape(t, -1)
    kn = norm(k.reshape(t, -1, d), kw, eps).reshape(t, -1)
    return rotary_ref(qn, kn, pos, cache, d)


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,hq,hk", [(64, 9, 3), (96, 4, 1)])   # 96: half 48, a masked tile
def test_matches_norm_then_rotary(zero_centred, dtype, d, hq, hk):
    rope = RotaryEmbedding(d, 512, 10000.0).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    qw = (torch.rand(d, generator=g) + 0.5).to(DEVICE, dtype)
    kw = (torch.rand(d, generator=g) - 0.5).to(DEVICE, dtype)
    qkv, q, k, v = _qkv(6, hq, hk, d, dtype, seed=2)
    pos = torch.tensor([0, 3, 7, 100, 511, 42], device=DEVICE)
    want_q, want_k = _chain(q, k, qw, kw, 1e-6, pos, rope.cos_sin_cache, d, zero_centred)
    v_before = v.clone()
    out_q, out_k = qk_norm_rotary_inplace(q, k, qw, kw, 1e-6, pos, rope.cos_sin_cache, d,
                                          zero_centred=zero_centred)
    assert out_q is q and out_k is k                       # in place, in the qkv buffer
    tol = 1e-5 if dtype == torch.float32 else 4e-3         # fp16: one rounding apart at most
    torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k, want_k, rtol=tol, atol=tol)
    assert torch.equal(v, v_before)


def test_rejects_bad_weights_and_strides():
    cache = RotaryEmbedding(8, 16, 10000.0).cos_sin_cache.to(DEVICE)
    q = torch.randn(3, 16, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        qk_norm_rotary_inplace(q, torch.randn(3, 32, device=DEVICE)[:, ::2], w, w, 1e-6, pos,
                               cache, 8)
    with pytest.raises(ValueError, match=r"\[8\]"):
        qk_norm_rotary_inplace(q, q.clone(), torch.ones(16, device=DEVICE), w, 1e-6, pos,
                               cache, 8)


def _layer(norm_cls, d=32, params=None, triton=True):
    rope = RotaryEmbedding(d, 64, 10000.0, params).to(DEVICE)
    qn, kn = norm_cls(d, 1e-6, torch.float32).to(DEVICE), norm_cls(d, 1e-6, torch.float32).to(DEVICE)
    with torch.no_grad():
        qn.weight.uniform_(0.5, 1.5)
        kn.weight.uniform_(-0.5, 0.5)
    mods = torch.nn.ModuleList([rope, qn, kn])
    select_ops(mods, triton)
    return rope, qn, kn


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
def test_norm_rotate_applies_on_the_triton_path_only(norm_cls, monkeypatch):
    d = 32
    rope, qn, kn = _layer(norm_cls)
    _, q, k, _ = _qkv(4, 4, 2, d, torch.float32, seed=5)
    pos = torch.tensor([1, 2, 3, 60], device=DEVICE)
    want = _chain(q, k, qn.weight, kn.weight, 1e-6, pos, rope.cos_sin_cache, d,
                  norm_cls is GemmaRMSNorm)
    got = rope.norm_rotate(q, k, pos, qn, kn)
    assert got is not None and got[0] is q
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    # where it does not apply the caller runs the norms and rotate itself
    eager = _layer(norm_cls, triton=False)
    assert eager[0].norm_rotate(q, k, pos, eager[1], eager[2]) is None
    partial = _layer(norm_cls, params={"rope_type": "default", "partial_rotary_factor": 0.5})
    assert partial[0].norm_rotate(q, k, pos, partial[1], partial[2]) is None
    assert rope.norm_rotate(q, k, pos, qn, GemmaRMSNorm(d, 1e-6, torch.float32)
                            if norm_cls is RMSNorm else RMSNorm(d, 1e-6, torch.float32)) is None
    monkeypatch.setattr(rotary_mod, "QK_NORM_ROTARY", False)   # FERRY_QK_NORM_ROTARY=0
    assert rope.norm_rotate(q, k, pos, qn, kn) is None
