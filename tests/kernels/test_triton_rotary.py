"""Fused rotary kernel against the one eager version, ``kernels.reference.rotary_ref``
(interpreter on the CPU, compiled on GPUs)."""

import pytest
import torch
from kernel_test_utils import DEVICE

from engine.layers.rotary import RotaryEmbedding
from kernels.reference import rotary_ref
from kernels.rotary import rotary_inplace


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,hq,hk", [(64, 9, 3), (128, 8, 2)])
def test_rotary_matches_reference(dtype, head_dim, hq, hk):
    kernel_device = DEVICE
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(head_dim, 512, 10000.0).to(kernel_device)
    cache = rope.cos_sin_cache
    t = 7
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=g).to(kernel_device, dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    pos = torch.tensor([0, 1, 5, 100, 511, 3, 2], device=kernel_device)
    before_qkv = qkv.clone()
    ref_q, ref_k = rotary_ref(q, k, pos, cache, head_dim)
    assert torch.equal(qkv, before_qkv)             # the reference is out-of-place
    # the model's eager path (the layer's default impl) is the same function
    assert rope.impl is rotary_ref
    lay_q, lay_k = rope.rotate(q, k, pos)
    assert torch.equal(lay_q, ref_q) and torch.equal(lay_k, ref_k)
    before_v = qkv[:, (hq + hk) * head_dim:].clone()
    out_q, out_k = rotary_inplace(q, k, pos, cache, head_dim)
    assert out_q is q and out_k is k                # the kernel rotates in place
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(q, ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k, ref_k, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (hq + hk) * head_dim:], before_v)  # v untouched
    # position 0 is the identity rotation
    torch.testing.assert_close(q[0], before_qkv[0, :hq * head_dim])


def test_rotary_rejects_strided_last_dim():
    q = torch.randn(3, 16, device=DEVICE)
    bad = torch.randn(3, 32, device=DEVICE)[:, ::2]  # last-dim stride 2
    cache = RotaryEmbedding(8, 16, 10000.0).cos_sin_cache.to(DEVICE)
    with pytest.raises(ValueError):
        rotary_inplace(q, bad, torch.zeros(3, dtype=torch.int64, device=DEVICE), cache, 8)
