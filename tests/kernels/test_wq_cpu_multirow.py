"""ferry's C++ CPU ``wq_linear`` at the row counts that pick its different kernels, against
dequantize-then-matmul in float64.

``kernels/cpu/wq.cpp`` runs 1-3 activation rows through a per-row group-dot kernel and 4 or
more through tiles of up to 16 rows that share one unpacking of each 32-weight chunk (17
rows: tiles of 9 and 8). The same weights are multiplied by M in {1, 3, 4, 8, 16, 17, 33}
rows; every row of the product must match the reference, and row i of a bigger batch must
not depend on which tile it landed in (compared with the same row computed alone, within the
fp32 summation-order tolerance). Shapes: SmolLM2's o_proj-like 576-wide rows (18 groups of
32), an odd N (so threads split unevenly), the GGUF Q4_1/Q8_0 layouts with fp16 scales and
an AWQ-like q4 with 128-weight groups.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels.quant.reference import dequant, pack_q4

pytestmark = pytest.mark.skipif(
    (shutil.which("g++") is None and shutil.which("c++") is None)
    or os.environ.get("FERRY_CPU_KERNELS") == "0",
    reason="no C++ compiler (or FERRY_CPU_KERNELS=0)")

M_VALUES = (1, 3, 4, 8, 16, 17, 33)


def _weights(fmt: str, n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(torch.float16)
    if fmt == "q4":
        q = torch.randint(0, 16, (n, k), generator=g)
        mins = (torch.randn(n, k // group, generator=g) * 0.05).to(torch.float16)
        return pack_q4(q), scales, mins
    return torch.randint(-128, 128, (n, k), generator=g).to(torch.int8), scales, None


@pytest.mark.parametrize("fmt,group", [("q4", 32), ("q8", 32), ("q4", 128)])
def test_wq_linear_every_tile_size_matches_dequant_matmul(fmt, group):
    from kernels import cpu_ops

    assert cpu_ops.load()
    n, k = 45, 640 if group == 128 else 576
    qw, s, mins = _weights(fmt, n, k, group, seed=7)
    w64 = dequant(fmt, qw, s, mins).double()
    x = torch.randn(max(M_VALUES), k, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([torch.ops.ferry_cpu.wq_linear(x[i:i + 1], qw, s, mins)
                       for i in range(x.shape[0])])
    for m in M_VALUES:
        ref = x[:m].double() @ w64.t()
        y = torch.ops.ferry_cpu.wq_linear(x[:m].contiguous(), qw, s, mins)
        assert y.shape == (m, n) and y.dtype == torch.float32
        tol = 1e-5 * ref.abs().max().item()  # fp32 sums in another order
        err = (y.double() - ref).abs().max().item()
        assert err <= tol, f"M={m}: max error {err:.3g} > {tol:.3g}"
        # a row's result does not depend on the tile (or kernel) it ran in
        assert torch.allclose(y, alone[:m], rtol=0, atol=tol)


def test_wq_linear_multirow_bf16_activations():
    """bf16 x at M = 8: computed in fp32 from the bf16 values, one rounding of the output."""
    from kernels import cpu_ops

    assert cpu_ops.load()
    qw, s, mins = _weights("q4", 33, 576, 32, seed=3)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = x.double() @ dequant("q4", qw, s, mins).double().t()
    y = torch.ops.ferry_cpu.wq_linear(x, qw, s, mins)
    assert y.dtype == torch.bfloat16
    assert (y.double() - ref).abs().max() <= 8e-3 * ref.abs().max()
