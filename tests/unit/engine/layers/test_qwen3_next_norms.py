"""Qwen3-Next's norms (engine/layers/norm.py): the zero-centred RMSNorm and the gated RMSNorm
against HF's ``Qwen3NextRMSNorm`` and ``Qwen3NextRMSNormGated``, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from engine.layers.norm import GatedRMSNorm, ZeroCenteredRMSNorm

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centered_rms_norm_matches_hf(dtype):
    torch.manual_seed(0)
    ref = hf.Qwen3NextRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    ref = ref.to(dtype)
    ours = ZeroCenteredRMSNorm(16, 1e-6, dtype)
    ours.load_state_dict(ref.state_dict())
    x, r = torch.randn(5, 16).to(dtype), torch.randn(5, 16).to(dtype)
    torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)
    normed, resid = ours(x, r)
    torch.testing.assert_close(resid, x + r, atol=0, rtol=0)
    torch.testing.assert_close(normed, ref(x + r), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_hf(dtype):
    torch.manual_seed(1)
    ref = hf.Qwen3NextRMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    ref = ref.to(dtype)
    ours = GatedRMSNorm(8, 1e-6, dtype)
    ours.load_state_dict(ref.state_dict())
    x, z = torch.randn(6, 8).to(dtype), torch.randn(6, 8).to(dtype)
    torch.testing.assert_close(ours(x, z), ref(x, z), atol=0, rtol=0)
