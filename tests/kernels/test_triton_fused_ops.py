"""Fused RMSNorm(+residual) and SiLU-and-mul vs the one eager version in kernels.reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, GPU_MARKS, assert_close, randn

from kernels.fused_ops import gemma_rms_norm, rms_norm, silu_and_mul
from kernels.reference import gemma_rms_norm_ref, rms_norm_ref, silu_and_mul_ref

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


def _hf_llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Independent check of rms_norm_ref: HF LlamaRMSNorm.forward, written out."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("shape,dtype,with_residual", [
    ((7, 576), F32, False),          # SmolLM2-135M hidden size
    ((3, 5, 576), F16, True),
    ((4, 80), F16, False),           # tiny, non power of two
    ((2, 4096), F32, True),          # Llama-3-8B hidden size
    pytest.param((33, 4096), BF16, True, marks=GPU_MARKS),
])
def test_rms_norm_matches_reference(shape, dtype, with_residual):
    eps = 1e-5
    x = randn(shape, dtype, 1, scale=3.0)
    w = randn(shape[-1:], dtype, 2)
    res = randn(shape, dtype, 3) if with_residual else None
    got = rms_norm(x, w, eps, residual=res)
    want = rms_norm_ref(x, w, eps, residual=res)
    if with_residual:
        (got, got_res), (want, want_res) = got, want
        assert got_res.dtype == dtype and got_res.shape == x.shape
        assert_close(got_res, want_res, dtype, "residual sum")
        assert_close(want, _hf_llama_rms_norm(x + res, w, eps), dtype, "reference vs HF")
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, want, dtype, "rms_norm")


def _hf_gemma3_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Independent check: HF Gemma3RMSNorm on the same weight."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    hf = Gemma3RMSNorm(x.shape[-1], eps=eps).to(weight.dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        return hf(x)


@pytest.mark.parametrize("shape,dtype,with_residual", [
    ((7, 576), F32, False),
    ((3, 5, 128), F16, True),        # a per-head q/k norm shape
    ((4, 80), F16, False),
    pytest.param((33, 5376), BF16, True, marks=GPU_MARKS),   # Gemma-3-27B hidden size
])
def test_gemma_rms_norm_matches_reference_and_hf(shape, dtype, with_residual):
    eps = 1e-6
    x = randn(shape, dtype, 1, scale=3.0)
    w = randn(shape[-1:], dtype, 2)                  # zero-centred: 1 + w scales
    res = randn(shape, dtype, 3) if with_residual else None
    got = gemma_rms_norm(x, w, eps, residual=res)
    want = gemma_rms_norm_ref(x, w, eps, residual=res)
    if with_residual:
        (got, got_res), (want, want_res) = got, want
        assert_close(got_res, want_res, dtype, "residual sum")
    summed = x + res if with_residual else x
    if x.device.type == "cpu":
        assert torch.equal(want, _hf_gemma3_rms_norm(summed, w, eps))  # same ops as HF
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, want, dtype, "gemma_rms_norm")
    # not Llama's norm: the (1 + w) scale is what the kernel applied
    assert (got.float() - rms_norm_ref(summed, w, eps).float()).abs().max() > 0.1


def test_rms_norm_strided_rows_and_errors():
    big = randn((6, 2 * 576), F32, 4)
    x = big[:, :576]                                   # row stride 1152
    w = randn((576,), F32, 5)
    assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), F32, "strided rms_norm")
    with pytest.raises(ValueError):
        rms_norm(x, randn((575,), F32, 6), 1e-6)
    with pytest.raises(ValueError):
        rms_norm(big.t(), randn((6,), F32, 6), 1e-6)   # last axis not unit stride


@pytest.mark.parametrize("shape,dtype", [
    ((5, 2 * 1536), F32),            # SmolLM2-135M intermediate size
    ((2, 3, 2 * 100), F16),          # not a multiple of the block
    ((1, 2 * 3000), F16),            # several column blocks
    pytest.param((64, 2 * 14336), BF16, marks=GPU_MARKS),   # Llama-3-8B
])
def test_silu_and_mul_matches_reference(shape, dtype):
    x = randn(shape, dtype, 7, scale=4.0)
    got = silu_and_mul(x)
    i = shape[-1] // 2
    gate, up = x[..., :i].double(), x[..., i:].double()
    exact = gate * torch.sigmoid(gate) * up          # fp64, independent of the reference
    assert got.shape == (*shape[:-1], i) and got.dtype == dtype
    assert_close(got, silu_and_mul_ref(x), dtype, "silu_and_mul vs ref")
    assert_close(got, exact, dtype, "silu_and_mul vs fp64")


def test_silu_and_mul_errors_and_empty():
    with pytest.raises(ValueError):
        silu_and_mul(randn((2, 7), F32, 1))
    assert silu_and_mul(torch.empty((0, 8), device=DEVICE)).shape == (0, 4)
