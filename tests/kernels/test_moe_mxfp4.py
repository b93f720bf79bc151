"""MXFP4 expert weights (gpt-oss): the torch dequantization against transformers' own, the
quantizer's round trip, and the Triton fused MoE with biases, the clamped SwiGLU and MXFP4
blocks dequantized in registers, against dequantize-then-``fused_moe_torch`` (interpreter on
the CPU: fp16/fp32, since a bf16 ``tl.dot`` is unreliable there; natively on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, gpu_only, rel_err

from kernels.moe.fused_moe_mxfp4 import fused_moe_oai
from kernels.moe.mxfp4 import E2M1_VALUES, dequantize_mxfp4, dummy_mxfp4, quantize_mxfp4
from kernels.moe.reference import fused_moe_torch, swiglu_oai

F16, F32 = torch.float16, torch.float32


def _random_mxfp4(lead: tuple[int, ...], k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 125, (*lead, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers():
    """Element 2j is the low nibble, the scale is 2 ** (s - 127); HF's helper returns the
    [E, K, N] transpose."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 40), 96, seed=1)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)              # [3, 40, 96]
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, hf.transpose(1, 2))
    one = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)
    got = dequantize_mxfp4(one, torch.tensor([[128]], dtype=torch.uint8))
    assert got[0, :2].tolist() == [2 * E2M1_VALUES[1], 2 * E2M1_VALUES[2]]


def test_quantize_round_trip_and_dummy():
    w = torch.randn(5, 8, 64, generator=torch.Generator().manual_seed(2))
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (5, 8, 2, 16) and scales.shape == (5, 8, 2)
    deq = dequantize_mxfp4(blocks, scales)
    assert torch.equal(quantize_mxfp4(deq)[0], blocks)                  # values stay put
    assert rel_err(deq, w) < 0.15
    b, s = dummy_mxfp4(torch.rand(4, 6, 2, 16) * 2 - 1)
    assert b.dtype == s.dtype == torch.uint8 and int(s.min()) >= 120 and int(s.max()) <= 122
    assert dequantize_mxfp4(b, s).abs().max() <= 6 * 2.0 ** -5


def _routing(m: int, num_experts: int, top_k: int, seed: int):
    """Random top-k ids (experts num_experts - 1 never chosen: an expert with no token) and
    weights; one pair dropped (id -1, as expert parallelism marks other ranks')."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts - 1, generator=g)[:top_k] for _ in range(m)])
    if m > 1:
        ids[1, 0] = -1
    w = torch.softmax(torch.randn(m, top_k, generator=g), -1)
    return w, ids.to(torch.int32)


@pytest.mark.parametrize("m,num_experts,top_k,hidden,inter,dtype,mx", [
    (1, 4, 2, 64, 32, F32, True),
    (7, 8, 2, 64, 64, F16, True),
    (40, 8, 4, 96, 64, F32, True),
    (40, 8, 4, 96, 64, F16, False),         # the bf16/float fallback with bias and clamp
])
def test_triton_oai_moe_matches_reference(m, num_experts, top_k, hidden, inter, dtype, mx):
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, hidden, generator=g)).to(dtype)
    b13 = (0.1 * torch.randn(num_experts, 2 * inter, generator=g)).to(dtype)
    b2 = (0.1 * torch.randn(num_experts, hidden, generator=g)).to(dtype)
    weights, ids = _routing(m, num_experts, top_k, seed=m + 3)
    kw = dict(w13_bias=b13, w2_bias=b2, activation="swiglu_oai", swiglu_alpha=1.702,
              swiglu_limit=1.0)
    if mx:
        w13, s13 = _random_mxfp4((num_experts, 2 * inter), hidden, seed=m + 5)
        w2, s2 = _random_mxfp4((num_experts, hidden), inter, seed=m + 6)
        dense = (dequantize_mxfp4(w13, s13, dtype), dequantize_mxfp4(w2, s2, dtype))
        ref = fused_moe_torch(x, *dense, weights, ids, **kw)
        cpu = fused_moe_torch(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2, **kw)
        assert torch.equal(cpu, ref)       # the CPU path dequantizes per call, the same
        kw.update(w13_scales=s13.to(DEVICE), w2_scales=s2.to(DEVICE))
    else:
        w13 = (0.1 * torch.randn(num_experts, 2 * inter, hidden, generator=g)).to(dtype)
        w2 = (0.1 * torch.randn(num_experts, hidden, inter, generator=g)).to(dtype)
        ref = fused_moe_torch(x, w13, w2, weights, ids, **kw)
    kw = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in kw.items()}
    out = fused_moe_oai(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE),
                        ids.to(DEVICE), **kw,
                        config=dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32,
                                    GROUP_SIZE_M=1, num_warps=4, num_stages=2))
    assert rel_err(out, ref) < (2e-5 if dtype == F32 else 3e-3)


def _oai_case(m: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype,
              device: str, seed: int = 0):
    """Random activations, biases, softmax top-k routing and MXFP4 experts (scales near
    2^-6, as the dummy loader draws them) on ``device``; returns (x, w13, s13, w2, s2,
    weights, ids, kw)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(device, dtype)
    w13, s13 = _random_mxfp4((num_experts, 2 * inter), hidden, seed=seed + 1)
    w2, s2 = _random_mxfp4((num_experts, hidden), inter, seed=seed + 2)
    weights, ids = torch.topk(torch.softmax(torch.randn(m, num_experts, generator=g), -1),
                              top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    kw = dict(w13_bias=(0.1 * torch.randn(num_experts, 2 * inter, generator=g)).to(device, dtype),
              w2_bias=(0.1 * torch.randn(num_experts, hidden, generator=g)).to(device, dtype),
              activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)
    return (x, w13.to(device), s13.to(device), w2.to(device), s2.to(device),
            weights.to(device), ids.to(device, torch.int32), kw)


@gpu_only
@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("model,num_experts", [("gpt-oss-20b", 8), ("gpt-oss-120b", 8)])
def test_triton_mxfp4_moe_bf16_at_gpt_oss_shapes(model, num_experts, m):
    """bf16 activations, the shipped expert shape (hidden = intermediate = 2880: 90 scale
    groups a row, not a power of two), top-4 of a few experts, the launch configuration
    the engine picks; against the torch reference in fp32 on the dequantized weights."""
    x, w13, s13, w2, s2, weights, ids, kw = _oai_case(m, num_experts, 4, 2880, 2880,
                                                       torch.bfloat16, DEVICE, seed=m)
    from engine.device import device_name

    out = fused_moe_oai(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2, **kw,
                        device_name=device_name(DEVICE))
    f32 = {k: v.float() if torch.is_tensor(v) else v for k, v in kw.items()}
    ref = fused_moe_torch(x.float(), dequantize_mxfp4(w13, s13, F32),
                          dequantize_mxfp4(w2, s2, F32), weights, ids, **f32)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_err(out, ref) < 1.6e-2, model
    dense = fused_moe_oai(x, dequantize_mxfp4(w13, s13, torch.bfloat16),
                          dequantize_mxfp4(w2, s2, torch.bfloat16), weights, ids, **kw)
    assert rel_err(dense, ref) < 1.6e-2, f"{model}: the bf16-weight path"


def test_oai_case_runs_in_the_interpreter():
    """``_oai_case`` (the GPU test's inputs) at a small shape in fp32 through the Triton
    kernel on this machine's device: the GPU test's own code path, checked here."""
    x, w13, s13, w2, s2, weights, ids, kw = _oai_case(5, 4, 2, 64, 64, F32, DEVICE, seed=3)
    out = fused_moe_oai(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2, **kw,
                        config=dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32,
                                    GROUP_SIZE_M=1, num_warps=4, num_stages=2))
    ref = fused_moe_torch(x, dequantize_mxfp4(w13, s13, F32), dequantize_mxfp4(w2, s2, F32),
                          weights, ids, **kw)
    assert rel_err(out, ref) < 2e-5


def test_dummy_experts_at_the_shipped_shape_keep_activations_finite():
    """The dummy loader's MXFP4 experts (``dummy_mxfp4`` of uniform noise) at gpt-oss's
    shipped expert shape (hidden = intermediate = 2880, 90 scale groups a row): scales
    2^-7..2^-5, and one MoE layer on unit-variance activations (as after the RMSNorm) gives
    finite outputs of order one, so 24-36 such layers stay finite in bf16 too."""
    g = torch.Generator().manual_seed(0)
    w13, s13 = dummy_mxfp4(torch.rand(2, 5760, 90, 16, generator=g) * 2 - 1)
    w2, s2 = dummy_mxfp4(torch.rand(2, 2880, 90, 16, generator=g) * 2 - 1)
    assert w13.dtype == s13.dtype == torch.uint8
    assert 120 <= int(s13.min()) and int(s13.max()) <= 122
    x = torch.randn(3, 2880, generator=g)
    weights, ids = torch.full((3, 2), 0.5), torch.tensor([[0, 1]] * 3, dtype=torch.int32)
    out = fused_moe_torch(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2,
                          activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)
    assert torch.isfinite(out).all() and 0.05 < out.std().item() < 20


def test_swiglu_oai_matches_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    ex = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=4, num_local_experts=1,
                                    swiglu_limit=1.5))
    gu = 3 * torch.randn(5, 8, generator=torch.Generator().manual_seed(4))
    hf = ex._apply_gate(gu)
    ours = swiglu_oai(torch.cat([gu[:, ::2], gu[:, 1::2]], -1), ex.alpha, ex.limit)
    assert torch.allclose(ours, hf)
