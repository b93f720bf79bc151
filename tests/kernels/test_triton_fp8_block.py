"""Block-wise FP8 kernels (``kernels.fp8.block_triton``) against the torch reference
(``kernels.fp8.reference``), and the reference against a float64 computation written
here from the published scheme (DeepSeek-V3: ``W = Wq * scale_inv`` per 128 x 128 block,
activations per token per 128 columns).

In the interpreter (CPU): the activation quantizer, the weight-only mode in fp16/fp32, and
W8A8 with the e4m3 tiles upcast to fp16 (the products the FP8 dot computes). The e4m3
``tl.dot`` and the DeepSeek-V3 / Qwen3-8B shapes run on a GPU (marker ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, ON_GPU, gpu_only

from kernels.fp8.block_triton import (
    fp8_block_linear,
    quantize_act_groups_triton,
)
from kernels.fp8.reference import (
    dequantize_weight_blocks,
    fp8_block_linear_reference,
    quantize_act_groups,
    quantize_weight_blocks,
)
from kernels.split_k import split_k_locks


def _weights(n, k, block, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[: block[0], : block[1]] *= 30          # one block with a much larger scale
    wq, s = quantize_weight_blocks(w, block)
    return w, wq, s


def _x(m, k, seed, dtype=torch.float32):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, k // 3] = 25.0                      # an outlier sets one group's scale
    return x.to(dtype)


def test_reference_by_hand_on_one_block():
    """A 2 x 3 weight in one block: the scale is amax / 448 and the codes round
    ``w / scale``; a 2 x 2 grid of blocks of a 3 x 5 weight with partial blocks keeps each
    block's own scale; the dequantized weight is within half an e4m3 step of w."""
    w = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.25, -0.125]])
    wq, s = quantize_weight_blocks(w, (128, 128))
    assert s.shape == (1, 1) and float(s) == pytest.approx(4.0 / 448)
    assert wq.float()[1, 0] == 448.0
    w = torch.arange(15, dtype=torch.float32).view(3, 5) + 1
    wq, s = quantize_weight_blocks(w, (2, 4))
    assert s.shape == (2, 2)
    want = torch.tensor([[9.0, 10.0], [14.0, 15.0]]) / 448
    assert torch.allclose(s, want)
    deq = dequantize_weight_blocks(wq, s, 4, 2)
    assert ((deq - w).abs() <= w.abs() * 2 ** -4).all()


def test_reference_w8a8_is_the_blockwise_sum_in_float64():
    """``fp8_block_linear_reference`` (dequantize, one matmul) equals the published
    blockwise sum ``sum_j (xq_j @ Wq_j^T) * sx_j * S_j^T`` in float64."""
    m, n, k, bk = 5, 48, 200, 64
    _, wq, s = _weights(n, k, (32, bk), 0)
    x = _x(m, k, 1)
    xq, sx = quantize_act_groups(x, bk)
    want = torch.zeros(m, n, dtype=torch.float64)
    for j in range(s.shape[1]):
        cols = slice(j * bk, min(k, (j + 1) * bk))
        part = xq[:, cols].double() @ wq[:, cols].double().t()
        sw = s[:, j].double().repeat_interleave(32)[:n]
        want += part * sx[:, j:j + 1].double() * sw[None, :]
    got = fp8_block_linear_reference(x, wq, s, bk, 32, quant_x=True)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("m,k,group", [(1, 128, 128), (3, 200, 64), (7, 96, 32)])
def test_act_quantizer_matches_the_reference(m, k, group):
    """Scales equal the reference's (up to Triton's division); the codes dequantize to
    within one e4m3 step of the reference's."""
    x = _x(m, k, m)
    q, s = quantize_act_groups_triton(x.to(DEVICE), group)
    rq, rs = quantize_act_groups(x, group)
    assert q.shape == (m, k) and s.shape == rs.shape == (m, -(-k // group))
    assert torch.allclose(s.cpu(), rs, rtol=1e-6)
    got, want = q.cpu().float(), rq.float()
    diff = got != want
    if ON_GPU:
        assert diff.float().mean() < 1e-3
    else:
        # the interpreter casts a value that rounds up to a power of two down a binade
        # (kernels/fp8/fp8_triton.py): those codes, and only those, are half the reference's
        pow2 = torch.log2(want.abs()).frac() == 0
        assert (pow2[diff] & (got[diff] == want[diff] / 2)).all()


def _cfg(m, split=1):
    return dict(SPLIT_K=split, BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


@pytest.mark.parametrize("m,n,k,block,split,row_div", [
    (1, 48, 200, (32, 64), 1, 32),    # K and N not multiples of the tiles or blocks
    (3, 40, 96, (16, 32), 2, 16),     # split K
    (5, 64, 300, (32, 64), 4, 1),     # one row of scales per weight row; a short last part
    (20, 24, 64, (16, 32), 1, 16),    # two blocks of rows
])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_weight_only_matches_the_reference(m, n, k, block, split, row_div, x_dtype):
    if x_dtype == torch.float16 and not ON_GPU and m > 16:
        pytest.skip("enough fp16 cases in the interpreter")
    _, wq, s = _weights(n, k, block, m)
    if row_div == 1:
        s = s.repeat_interleave(block[0], 0)[:n].contiguous()
    x = _x(m, k, m + 1, x_dtype)
    ref = fp8_block_linear_reference(x.float(), wq, s, block[1], row_div, quant_x=False)
    for _ in range(2):          # the split-K counters are back at 0 for the second launch
        y = fp8_block_linear(x.to(DEVICE), wq.to(DEVICE), s.to(DEVICE), block[1], row_div,
                             quant_x=False, out_dtype=torch.float32, config=_cfg(m, split))
        err = (y.cpu().double() - ref.double()).abs().max() / ref.abs().max()
        assert err < (1e-5 if x_dtype == torch.float32 else 2e-3), float(err)
        assert int(split_k_locks(y.device).abs().sum()) == 0


@pytest.mark.parametrize("m,n,k,block,split", [
    (2, 48, 200, (32, 64), 1), (17, 40, 96, (16, 32), 3), (5, 64, 300, (32, 64), 2)])
def test_w8a8_upcast_matches_float64_of_the_same_codes(m, n, k, block, split):
    """W8A8 with the tiles upcast to fp16 (exact products): equal to float64 of the
    kernel's own activation codes and scales with the weight codes and scales."""
    _, wq, s = _weights(n, k, block, m)
    x = _x(m, k, m + 2).to(DEVICE)
    xq, sx = quantize_act_groups_triton(x, block[1])
    xd = xq.cpu().double() * sx.cpu().double().repeat_interleave(block[1], 1)[:, :k]
    wd = dequantize_weight_blocks(wq, s, block[1], block[0]).double()
    ref = xd @ wd.t()
    y = fp8_block_linear(x, wq.to(DEVICE), s.to(DEVICE), block[1], block[0], quant_x=True,
                         upcast=True, out_dtype=torch.float32, config=_cfg(m, split))
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, float(err)


def test_bad_scale_shape_is_refused():
    _, wq, s = _weights(32, 64, (32, 32), 0)
    with pytest.raises(ValueError, match="do not cover K"):
        fp8_block_linear(torch.zeros(1, 64, device=DEVICE), wq.to(DEVICE), s[:, :1].to(DEVICE),
                         32, 32, quant_x=False)


# ---- GPU: the FP8 dot and the published shapes -------------------------------------------

SHAPES = [(7168, 18432), (7168, 2112), (4096, 12288)]   # (K, N): DeepSeek-V3 x2, Qwen3-8B


@gpu_only
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64, 256, 2048])
def test_published_shapes_against_the_reference_on_the_gpu(k, n, m):
    """bf16 activations at DeepSeek-V3 / Qwen3-8B shapes, 128 x 128 blocks, default
    configs: W8A8 with the FP8 dot (and its fp16 upcast) and weight-only against the
    reference computed in fp32 on the device from the same codes."""
    block = (128, 128)
    g = torch.Generator(device=DEVICE).manual_seed(m)
    w = torch.randn(n, k, generator=g, device=DEVICE) * 0.02
    wq, s = quantize_weight_blocks(w, block)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(torch.bfloat16)
    wdeq = dequantize_weight_blocks(wq, s, 128, 128)
    for quant_x, upcast in ((True, False), (True, True), (False, False)):
        if quant_x:
            xq, sx = quantize_act_groups_triton(x, 128)
            xin = xq.float() * sx.repeat_interleave(128, 1)
        else:
            xin = x.float()
        ref = xin @ wdeq.t()
        y = fp8_block_linear(x, wq, s, 128, 128, quant_x=quant_x, upcast=upcast)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < 8e-3, (quant_x, upcast, err)
    # the W8A8 answer is close to the float product (the quantization's own error)
    exact = x.float() @ w.t()
    assert ((y.float() - exact).norm() / exact.norm()).item() < 0.06
