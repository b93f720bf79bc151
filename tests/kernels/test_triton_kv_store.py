"""Triton ``store_kv`` vs ``kernels.reference.store_kv_ref``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, GPU_MARKS, randn

from kernels.kv_store import store_kv
from kernels.reference import store_kv_ref

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


@pytest.mark.parametrize("hkv,d,pool_dtype,src_dtype,fused,num_tokens", [
    (3, 64, F16, F16, False, 37),
    (8, 128, F32, F32, True, 20),
    (2, 80, F16, F32, False, 9),        # cast on store, non-power-of-two head_dim
    (1, 64, F32, F16, True, 1),
    pytest.param(8, 128, BF16, BF16, True, 300, marks=GPU_MARKS),
])
def test_store_kv_matches_reference(hkv, d, pool_dtype, src_dtype, fused, num_tokens):
    num_slots = 3 * num_tokens + 16
    g = torch.Generator().manual_seed(num_tokens)
    loc = torch.randperm(num_slots, generator=g)[:num_tokens].to(DEVICE)   # distinct slots
    if fused:   # k and v sliced out of one [T, (2 Hkv) D] tensor: row stride 2 * Hkv * D
        kv = randn((num_tokens, 2 * hkv * d), src_dtype, 1)
        k, v = kv[:, : hkv * d].view(-1, hkv, d), kv[:, hkv * d:].view(-1, hkv, d)
    else:
        k, v = randn((num_tokens, hkv, d), src_dtype, 1), randn((num_tokens, hkv, d), src_dtype, 2)
    kb = randn((num_slots, hkv, d), pool_dtype, 3)
    vb = randn((num_slots, hkv, d), pool_dtype, 4)
    kb_ref, vb_ref = kb.clone(), vb.clone()
    store_kv_ref(kb_ref, vb_ref, loc, k, v)
    store_kv(kb, vb, loc, k, v)
    # A copy (with a dtype cast) is exact; untouched slots must stay as they were.
    assert torch.equal(kb.cpu(), kb_ref.cpu())
    assert torch.equal(vb.cpu(), vb_ref.cpu())


def test_store_kv_empty_and_bad_shapes():
    kb = randn((8, 2, 64), F32, 1)
    before = kb.clone()
    empty = torch.empty((0, 2, 64), device=DEVICE)
    store_kv(kb, kb.clone(), torch.empty(0, dtype=torch.int64, device=DEVICE), empty, empty)
    assert torch.equal(kb, before)
    with pytest.raises(ValueError):
        store_kv(kb, kb.clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE),
                 randn((1, 2, 32), F32, 2), randn((1, 2, 32), F32, 3))



@pytest.mark.parametrize("pool_dtype", [
    pytest.param(torch.float8_e4m3fn, id="e4m3", marks=GPU_MARKS),
    pytest.param(torch.float8_e5m2, id="e5m2", marks=GPU_MARKS)])
def test_store_kv_fp8_pool(pool_dtype):
    """fp8 KV cache (--kv-cache-dtype): the store rounds to nearest even, exactly as torch's
    cast. GPU only: the CPU interpreter's fp8 cast is wrong when rounding carries into the
    exponent (1.956 became 1.0 instead of 2.0 with triton 3.9)."""
    hkv, d, n = 2, 64, 33
    loc = torch.arange(3, 3 + n, device=DEVICE)
    k = randn((n, hkv, d), BF16, 5, scale=3.0)
    v = randn((n, hkv, d), F16, 6, scale=3.0)
    kb = torch.zeros((n + 8, hkv, d), dtype=pool_dtype, device=DEVICE)
    vb = torch.zeros_like(kb)
    store_kv(kb, vb, loc, k, v)
    assert torch.equal(kb[loc].float(), k.to(pool_dtype).float())
    assert torch.equal(vb[loc].float(), v.to(pool_dtype).float())
    assert (kb[:3].float() == 0).all() and (kb[3 + n:].float() == 0).all()
