"""Triton small-M FP8 linear (``fp8_linear_small_m``) against a float64 computation of the
same quantized math.

The reference takes the activation codes from ``quantize_rows_triton`` (in the interpreter,
Triton casts a value that rounds up to a power of two down a binade, on a GPU it rounds as
torch does; either way the small-M kernel quantizes the same way), the e4m3 weight codes and
both scales, and multiplies in float64. On a GPU the result is also checked against
``quantize_rows_triton`` + ``torch._scaled_mm``, the path it replaces for M <= 16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, gpu_only

from kernels.fp8.fp8_triton import (
    SMALL_M_MAX,
    fp8_linear_fp8_dot,
    fp8_linear_small_m,
    quantize_rows_triton,
    small_m_config,
    split_k_locks,
)
from kernels.fp8.reference import quantize_rows


def _operands(m, n, k, seed, x_dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0, k // 3] = 30.0                       # an outlier channel sets row 0's scale
    w = torch.randn(n, k, generator=g) * 0.05
    w[n // 2] *= 40                           # one row with a much larger scale
    wq, sw = quantize_rows(w)
    return x.to(x_dtype).to(DEVICE), wq.to(DEVICE), sw.view(-1).to(DEVICE)


def _cfg(dot, m, split=1):
    return dict(USE_DOT=dot, SPLIT_K=split, BLOCK_K=32 if split > 1 else 64,
                BLOCK_M=max(16 if dot else 1, 1 << (m - 1).bit_length()), BLOCK_N=16,
                num_warps=4, num_stages=1)


@pytest.mark.parametrize("m,n,k,dot,split", [
    (1, 48, 200, True, 1),    # K not a multiple of the K tile, N not of the N tile
    (3, 40, 96, False, 1),    # the broadcast-and-sum path (no tl.dot)
    (5, 64, 128, True, 1),
    (16, 32, 64, True, 1),
    (1, 48, 200, True, 3),    # split K: the last K part has less than a tile
    (3, 40, 96, False, 2),
    (5, 64, 300, True, 4),
])
def test_w8a8_matches_float64_of_the_same_codes(m, n, k, dot, split):
    x, wq, sw = _operands(m, n, k, m, torch.float32)
    xq, sx = quantize_rows_triton(x)
    ref = (xq.cpu().double() @ wq.cpu().double().t()) * sx.cpu().double() * sw.cpu().double()
    for _ in range(2):        # the split-K arrival counters are back at 0 for the second
        y = fp8_linear_small_m(x, wq, sw, out_dtype=torch.float32, config=_cfg(dot, m, split))
        assert y.shape == (m, n) and y.dtype == torch.float32
        err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-6, float(err)
        assert int(split_k_locks(x.device).abs().sum()) == 0


@pytest.mark.parametrize("dot,x_dtype", [(True, torch.float16), (False, torch.float16),
                                         (True, torch.float32)])
def test_w8a16_multiplies_the_activations_unquantized(dot, x_dtype):
    m, n, k = 2, 24, 80
    x, wq, sw = _operands(m, n, k, 7, x_dtype)
    ref = x.cpu().double() @ (wq.cpu().double() * sw.cpu().double()[:, None]).t()
    y = fp8_linear_small_m(x, wq, sw, quant_x=False, out_dtype=torch.float32,
                           config=_cfg(dot, m))
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, float(err)
    # and it is not the W8A8 answer: activation quantization changes the result
    y8 = fp8_linear_small_m(x.float(), wq, sw, out_dtype=torch.float32, config=_cfg(dot, m))
    assert float((y8 - y).abs().max()) > 1e-4 * float(ref.abs().max())


def test_strided_input_and_default_config():
    m, n, k = 4, 32, 128
    x, wq, sw = _operands(m, n, 2 * k, 3, torch.float32)
    x = x[:, ::2]                              # column stride 2: copied to contiguous
    wq = wq[:, :k].contiguous()
    xq, sx = quantize_rows_triton(x.contiguous())
    ref = (xq.cpu().double() @ wq.cpu().double().t()) * sx.cpu().double() * sw.cpu().double()
    cfg = small_m_config(m, n, k)
    y = fp8_linear_small_m(x, wq, sw, out_dtype=torch.float32, config=cfg)
    assert float((y.cpu().double() - ref).abs().max() / ref.abs().max()) < 1e-6


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)], ids=["qkv", "down"])
@pytest.mark.parametrize("m", [1, 8, SMALL_M_MAX])
@gpu_only
def test_small_m_matches_scaled_mm_on_the_llama3_8b_shapes(m, n, k):
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    wq, sw = quantize_rows(torch.randn(n, k, generator=g) * 0.02)
    wq, sw = wq.to(DEVICE), sw.view(-1).to(DEVICE)
    xq, sx = quantize_rows_triton(x)
    ref = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.unsqueeze(0),
                           out_dtype=torch.bfloat16).float()
    y = fp8_linear_small_m(x, wq, sw, out_dtype=torch.bfloat16).float()
    err = (y - ref).norm() / ref.norm()
    assert err < 5e-3, float(err)          # bf16 rounding of both outputs, sum order
    # split K: 50 launches in a row (the arrival counters must reset every time) agree
    # with each other bit for bit (the parts are summed in a fixed order)
    outs = [fp8_linear_small_m(x, wq, sw, out_dtype=torch.bfloat16) for _ in range(50)]
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("m,n,k,split", [(32, 96, 320, 1), (64, 80, 512, 2), (17, 64, 256, 4)])
@gpu_only
def test_fp8_dot_mode_matches_float64_of_the_same_codes(m, n, k, split):
    """W8A8 on the FP8 tensor cores (``fp8_linear_fp8_dot``: e4m3 x e4m3 ``tl.dot``): the
    exact products of the codes, summed in fp32, scaled by both scales."""
    x, wq, sw = _operands(m, n, k, m, torch.bfloat16)
    xq, sx = quantize_rows_triton(x)
    ref = (xq.cpu().double() @ wq.cpu().double().t()) * sx.cpu().double() * sw.cpu().double()
    cfg = dict(USE_DOT=True, SPLIT_K=split, BLOCK_M=max(16, 1 << (m - 1).bit_length()),
               BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    for config in (cfg, None):                 # a small tile, then the default rule
        y = fp8_linear_fp8_dot(x, wq, sw, config=config)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
        assert err < 8e-3, float(err)          # the bf16 output's rounding
        assert int(split_k_locks(x.device).abs().sum()) == 0
