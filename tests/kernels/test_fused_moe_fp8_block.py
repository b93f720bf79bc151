"""The fused MoE with block-wise FP8 experts (``kernels.moe.fused_moe_fp8``) against the
float reference (``fused_moe_torch``) on the dequantized experts: in the interpreter with
fp16/fp32 activations and small blocks, on a GPU (``gpu``) in bf16 at Qwen3-30B-A3B's and
DeepSeek-V3's expert shapes with 128 x 128 blocks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, gpu_only

from kernels.fp8.reference import quantize_weight_blocks
from kernels.moe.fused_moe_fp8 import fused_moe_fp8_block
from kernels.moe.reference import dequantize_fp8_block_experts, fused_moe_torch, select_experts


def _experts(e, n, k, block, gen):
    qs, ss = [], []
    for _ in range(e):
        w = torch.randn(n, k, generator=gen) * 0.1
        w[: block[0], : block[1]] *= 8
        q, s = quantize_weight_blocks(w, block)
        qs.append(q)
        ss.append(s)
    return torch.stack(qs), torch.stack(ss)


def _case(m, e, h, inter, top_k, block, dtype, per_row=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = _experts(e, 2 * inter, h, block, g)
    w2, s2 = _experts(e, h, inter, block, g)
    div13 = div2 = block[0]
    if per_row:   # one scale row per weight row (fused parts off the block grid)
        s13 = s13.repeat_interleave(block[0], 1)[:, : 2 * inter].contiguous()
        s2 = s2.repeat_interleave(block[0], 1)[:, :h].contiguous()
        div13 = div2 = 1
    x = torch.randn(m, h, generator=g).to(dtype)
    logits = torch.randn(m, e, generator=g)
    tw, ti = select_experts(logits, top_k, True)
    ti[0, 0] = -1     # a dropped pair
    return x, w13, s13, div13, w2, s2, div2, tw, ti


@pytest.mark.parametrize("m,e,h,inter,block,dtype,per_row", [
    (5, 4, 64, 48, (32, 32), torch.float32, False),     # I not a multiple of the block
    (20, 6, 96, 64, (16, 32), torch.float16, False),    # H 3 blocks of K
    (3, 4, 64, 40, (32, 16), torch.float32, True),
])
def test_matches_the_float_reference_on_dequantized_experts(m, e, h, inter, block, dtype,
                                                             per_row):
    x, w13, s13, d13, w2, s2, d2, tw, ti = _case(m, e, h, inter, 2, block, dtype, per_row)
    bk = block[1]
    ref = fused_moe_torch(x.float(), dequantize_fp8_block_experts(w13, s13, bk, d13),
                          dequantize_fp8_block_experts(w2, s2, bk, d2), tw, ti)
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1,
               num_warps=4, num_stages=1)
    out = fused_moe_fp8_block(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), tw.to(DEVICE),
                              ti.to(DEVICE), w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE),
                              block_k=bk, w13_row_div=d13, w2_row_div=d2, config=cfg)
    assert out.dtype == dtype and out.shape == (m, h)
    err = ((out.cpu().float() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-3), err


def test_bad_shapes_are_refused():
    x, w13, s13, d13, w2, s2, d2, tw, ti = _case(2, 4, 64, 32, 2, (32, 32), torch.float32)
    with pytest.raises(ValueError, match="want e4m3"):
        fused_moe_fp8_block(x, w13.float(), w2, tw, ti, w13_scale=s13, w2_scale=s2,
                            block_k=32, w13_row_div=d13, w2_row_div=d2)


@gpu_only
@pytest.mark.parametrize("e,h,inter,top_k", [(32, 2048, 768, 8), (8, 7168, 2048, 8)])
@pytest.mark.parametrize("m", [1, 16, 256])
def test_published_expert_shapes_on_the_gpu(e, h, inter, top_k, m):
    """Qwen3-30B-A3B's experts (H 2048, I 768; 32 of its 128) and DeepSeek-V3's (H 7168,
    I 2048; 8 of its 256), bf16 activations, default configs."""
    x, w13, s13, d13, w2, s2, d2, tw, ti = _case(m, e, h, inter, top_k, (128, 128),
                                                 torch.bfloat16, seed=m)
    dev = DEVICE
    w13d = dequantize_fp8_block_experts(w13.to(dev), s13.to(dev), 128, d13, torch.bfloat16)
    w2d = dequantize_fp8_block_experts(w2.to(dev), s2.to(dev), 128, d2, torch.bfloat16)
    ref = fused_moe_torch(x.to(dev), w13d, w2d, tw.to(dev), ti.to(dev)).float()
    out = fused_moe_fp8_block(x.to(dev), w13.to(dev), w2.to(dev), tw.to(dev), ti.to(dev),
                              w13_scale=s13.to(dev), w2_scale=s2.to(dev), block_k=128,
                              w13_row_div=d13, w2_row_div=d2).float()
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2
