"""The one eager version of each small op (kernels/reference.py) against independent
computations: HF transformers' LlamaRMSNorm, LlamaMLP's activation and LlamaRotaryEmbedding
+ apply_rotary_pos_emb, fp64 formulas written out, and hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_config
from kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


def _randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------------------- RMSNorm


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(x.shape[-1], eps=eps).to(weight.dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        return hf(x)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_ref_matches_hf_llama_rms_norm(dtype, with_residual):
    eps = 1e-6
    x = _randn((3, 5, 96), dtype, 1, scale=3.0)
    w = _randn((96,), dtype, 2)
    res = _randn((3, 5, 96), dtype, 3) if with_residual else None
    x0, res0 = x.clone(), None if res is None else res.clone()
    got = rms_norm_ref(x, w, eps, res)
    if with_residual:
        got, got_res = got
        summed = x0 + res0                       # HF: hidden = residual + hidden, in dtype
        assert torch.equal(got_res, summed) and got_res.dtype == dtype
        assert torch.equal(res, res0)            # out-of-place
    else:
        summed = x0
    assert torch.equal(x, x0)
    want = _hf_rms_norm(summed, w, eps)
    assert got.dtype == want.dtype == dtype
    # same operations in the same order: bit-identical to HF
    assert torch.equal(got, want)
    # and the formula written out in fp64 (one rounding to dtype before the weight)
    xd = summed.double()
    y = (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    torch.testing.assert_close(got, (w.double() * y.double()).to(dtype))


def test_rms_norm_hand_value_and_layer():
    # x = [3, 4]: mean square 12.5, rsqrt -> [3, 4] / sqrt(12.5)
    x = torch.tensor([[3.0, 4.0]])
    w = torch.tensor([2.0, 0.5])
    r = math.sqrt(12.5)
    want = torch.tensor([[2 * 3 / r, 0.5 * 4 / r]])
    torch.testing.assert_close(rms_norm_ref(x, w, 0.0), want)
    norm = RMSNorm(2, 0.0, F32)
    with torch.no_grad():
        norm.weight.copy_(w)
    assert norm.impl is rms_norm_ref               # the eager default
    torch.testing.assert_close(norm(x), want)
    out, res = norm(torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 3.0]]))
    torch.testing.assert_close(res, x)
    torch.testing.assert_close(out, want)


# ---------------------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_silu_and_mul_ref_matches_hf_mlp_activation(dtype):
    from transformers.activations import ACT2FN

    x = _randn((4, 3, 2 * 40), dtype, 5, scale=4.0)
    x0 = x.clone()
    got = silu_and_mul_ref(x)
    assert torch.equal(x, x0) and got.shape == (4, 3, 40) and got.dtype == dtype
    gate, up = x[..., :40], x[..., 40:]
    torch.testing.assert_close(got, ACT2FN["silu"](gate) * up)     # HF LlamaMLP
    exact = gate.double() * torch.sigmoid(gate.double()) * up.double()
    torch.testing.assert_close(got, exact.to(dtype))
    assert torch.equal(SiluAndMul()(x), got)


def test_silu_and_mul_hand_value():
    # [gate | up] = [0, 1 | 2, 3] -> [0 * 2, 3 / (1 + e^-1)]
    got = silu_and_mul_ref(torch.tensor([[0.0, 1.0, 2.0, 3.0]]))
    torch.testing.assert_close(got, torch.tensor([[0.0, 3.0 / (1.0 + math.exp(-1.0))]]))


# ---------------------------------------------------------------------------- rotary


def test_rotary_ref_hand_rotation():
    # D = 2, theta 1: inv_freq = [1], so position p rotates (x1, x2) by p radians
    cache = RotaryEmbedding(2, 4, 10000.0).cos_sin_cache
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 2.0]])     # T=3, one head
    k = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 0.0]])
    pos = torch.tensor([1, 2, 0])
    rq, rk = rotary_ref(q, k, pos, cache, 2)
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(2), math.sin(2)
    torch.testing.assert_close(rq, torch.tensor([[c1, s1], [-s2, c2], [1.0, 2.0]]))
    torch.testing.assert_close(rk, torch.tensor([[2 * c1, 2 * s1], [2 * c2, 2 * s2], [0, 0.0]]))
    assert torch.equal(q, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 2.0]]))  # out-of-place


def _hf_config(rope: dict):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, rope_parameters=rope)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
])
def test_rotary_layer_matches_hf_apply_rotary_pos_emb(rope):
    """RotaryEmbedding (table) + rotary_ref vs HF's LlamaRotaryEmbedding and
    apply_rotary_pos_emb, fp32, for q [T, 4 heads * 32] and k [T, 2 heads * 32]."""
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = _hf_config(rope)
    theta, params = rope_config(cfg)
    ours = RotaryEmbedding(32, 256, theta, params)
    assert ours.impl is rotary_ref
    t, d = 9, 32
    q = _randn((t, 4 * d), F32, 11)
    k = _randn((t, 2 * d), F32, 12)
    pos = torch.tensor([0, 1, 2, 7, 31, 32, 100, 200, 255])
    got_q, got_k = ours.rotate(q, k, pos)
    hf = LlamaRotaryEmbedding(cfg)
    cos, sin = hf(q, pos[None])                                    # [1, T, D]
    hq = q.view(1, t, 4, d).transpose(1, 2)                        # [1, H, T, D]
    hk = k.view(1, t, 2, d).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(hq, hk, cos, sin)
    torch.testing.assert_close(got_q, want_q.transpose(1, 2).reshape(t, 4 * d),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k.transpose(1, 2).reshape(t, 2 * d),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_rotary_ref_low_precision_rounds_once(dtype):
    """fp16/bf16 inputs: the rotation runs in fp32 and is rounded once (fp64 formula)."""
    d, t = 16, 5
    rope = RotaryEmbedding(d, 64, 10000.0)
    q = _randn((t, 3, d), dtype, 21)                               # [T, H, D] also accepted
    k = _randn((t, d), dtype, 22)
    pos = torch.tensor([0, 3, 9, 40, 63])
    got_q, got_k = rotary_ref(q, k, pos, rope.cos_sin_cache, d)
    assert got_q.shape == q.shape and got_q.dtype == dtype and got_k.dtype == dtype
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv                              # [T, D/2]
    for x, got in ((q, got_q), (k, got_k)):
        xd = x.double().reshape(t, -1, d)
        x1, x2 = xd[..., : d // 2], xd[..., d // 2:]
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(x.shape)
        # one rounding of an fp32 result: within half an ulp (2^-9 bf16, 2^-12 fp16 relative)
        rtol = 2.0 ** -8 if dtype == BF16 else 2.0 ** -11
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-5)
