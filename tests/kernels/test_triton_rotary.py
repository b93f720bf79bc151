"""Fused rotary kernel against its torch reference (interpreter on the CPU, compiled on GPUs)."""

import pytest
import torch
from kernel_test_utils import DEVICE

from engine.layers.rotary import RotaryEmbedding, apply_rotary
from kernels.rotary import rotary_inplace, rotary_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,hq,hk", [(64, 9, 3), (128, 8, 2)])
def test_rotary_matches_reference(dtype, head_dim, hq, hk):
    kernel_device = DEVICE
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    cache = rope.cos_sin_cache.to(kernel_device)
    t = 7
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=g).to(kernel_device, dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    pos = torch.tensor([0, 1, 5, 100, 511, 3, 2], device=kernel_device)
    ref_q, ref_k = rotary_ref(q.clone(), k.clone(), pos, cache, head_dim)
    # the model's eager path is the same function
    cos, sin = rope.to(kernel_device)(pos)
    torch.testing.assert_close(apply_rotary(q, cos, sin, head_dim), ref_q)
    before_v = qkv[:, (hq + hk) * head_dim:].clone()
    rotary_inplace(q, k, pos, cache, head_dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(q, ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k, ref_k, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (hq + hk) * head_dim:], before_v)  # v untouched
    # position 0 is the identity rotation
    torch.testing.assert_close(q[0], ref_q[0])
