"""The q4 GEMV kernel of :mod:`kernels.quant.wq_triton` (decode rows, no ``tl.dot``; the
nibbles turned into floats by bit operations) and the tiled kernel's 16-bit "magic number"
codes, against the float64 product of the dequantized weight (the Triton interpreter on the
CPU: fp16 and fp32 activations)."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE

from kernels.quant.reference import dequant, pack_q4

pytest.importorskip("triton")


def _q4(n, k, group, sdtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(sdtype)
    mins = (torch.randn(n, k // group, generator=g) * 0.05).to(sdtype)
    return pack_q4(q), s, mins


@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,group,block_k,split", [
    (1, 7, 96, 32, 128, 1),       # K not a multiple of the tile; GGUF blocks: per-word scales
    (1, 33, 640, 128, 128, 3),    # one group per tile, split K (the last part past K)
    (2, 17, 384, 64, 64, 2),      # groups of 64, 64-weight tiles
    (3, 9, 512, 128, 256, 1),     # a tile over two groups: per-word scales; 3 of 4 rows
    (4, 65, 256, 32, 256, 2),
])
def test_gemv_matches_reference(xdtype, m, n, k, group, block_k, split):
    from kernels.quant.wq_triton import wq_linear

    qw, s, mins = _q4(n, k, group, torch.float16 if n % 2 else torch.float32, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(xdtype)
    ref = x.double() @ dequant("q4", qw, s, mins).double().t()
    cfg = dict(GEMV=True, SPLIT_K=split, BLOCK_M=triton_pow2(m), BLOCK_N=16, BLOCK_K=block_k)
    y = wq_linear(x.to(DEVICE), "q4", qw.to(DEVICE), s.to(DEVICE), mins.to(DEVICE), config=cfg)
    assert y.dtype == xdtype and y.shape == (m, n)
    tol = 2e-6 if xdtype == torch.float32 else 2e-3  # fp32 sums; fp16: the output's rounding
    assert (y.cpu().double() - ref).abs().max() <= tol * ref.abs().max()


def triton_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def test_default_rule_takes_the_gemv_for_decode_rows():
    from kernels.quant.wq_triton import GEMV_MAX_M, wq_config

    assert wq_config(1, 4096, 4096, 128).get("GEMV")
    assert wq_config(GEMV_MAX_M, 4096, 4096, 128)["BLOCK_M"] == triton_pow2(GEMV_MAX_M)
    assert not wq_config(GEMV_MAX_M + 1, 4096, 4096, 128).get("GEMV")
    assert not wq_config(1, 4096, 4096, 128, q4=False).get("GEMV")  # q8: the tiled kernel


@pytest.mark.parametrize("m", [5, 16])
def test_tiled_kernel_16_bit_codes_fp16(m):
    """The tiled kernel's fp16 path (codes as ``0x6400 | q`` = 1024 + q, the bias taken off
    after the dot) on one-group tiles."""
    from kernels.quant.wq_triton import wq_linear

    qw, s, mins = _q4(29, 384, 128, torch.float32, seed=m)
    x = torch.randn(m, 384, generator=torch.Generator().manual_seed(m)).half()
    ref = x.double() @ dequant("q4", qw, s, mins).double().t()
    cfg = dict(SPLIT_K=2, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128)
    y = wq_linear(x.to(DEVICE), "q4", qw.to(DEVICE), s.to(DEVICE), mins.to(DEVICE), config=cfg)
    assert (y.cpu().double() - ref).abs().max() <= 2e-3 * ref.abs().max()
