"""Weight-only q4/q8 kernels (GGUF blocks, AWQ/GPTQ groups) against the torch reference
(:func:`kernels.quant.reference.wq_matmul_ref`, computed again in float64 here): ferry's C++ CPU
kernels (``wq_linear``, ``wq_dequant``) and the Triton GEMM (in the interpreter on the CPU).

Shapes: M from 1 to 64, K a multiple of 32 but not of 64, 128 or 256 (96, 160, 608), odd N,
group sizes 32 and 128, fp16 and fp32 scales.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from kernel_test_utils import DEVICE

from kernels.quant.reference import dequant, pack_q4, unpack_q4, wq_matmul_ref

NO_COMPILER = shutil.which("g++") is None and shutil.which("c++") is None
needs_cpu_kernels = pytest.mark.skipif(
    NO_COMPILER or os.environ.get("FERRY_CPU_KERNELS") == "0",
    reason="no C++ compiler (or FERRY_CPU_KERNELS=0)")


def _weights(fmt, n, k, group, sdtype, seed):
    g = torch.Generator().manual_seed(seed)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(sdtype)
    if fmt == "q4":
        q = torch.randint(0, 16, (n, k), generator=g)
        mins = (torch.randn(n, k // group, generator=g) * 0.05).to(sdtype)
        return pack_q4(q), scales, mins
    return torch.randint(-128, 128, (n, k), generator=g).to(torch.int8), scales, None


def _ref64(x, fmt, qw, s, m):
    return (x.double() @ dequant(fmt, qw, s, m).double().t())


def test_pack_q4_hand_example():
    """One 32-weight chunk: byte j holds weight j (low nibble) and weight j + 16 (high)."""
    q = torch.arange(32).remainder(16).view(1, 32)       # 0..15, 0..15
    q[0, 16:] = 15 - q[0, 16:]                            # second half 15..0
    packed = pack_q4(q)
    assert packed.shape == (1, 16)
    assert packed[0, 0].item() == 0xF0 and packed[0, 1].item() == 0xE1
    assert packed[0, 15].item() == 0x0F
    assert torch.equal(unpack_q4(packed), q.to(torch.uint8))
    s, m = torch.tensor([[0.5]]), torch.tensor([[-1.0]])
    assert torch.equal(dequant("q4", packed, s, m)[0, :3], torch.tensor([-1.0, -0.5, 0.0]))


CASES = [(1, 7, 96, 32), (2, 33, 160, 32), (3, 17, 256, 128), (8, 9, 608, 32),
         (16, 31, 384, 128), (17, 5, 96, 32), (64, 13, 160, 32)]


@needs_cpu_kernels
@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("sdtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group", CASES)
def test_cpu_kernels_match_reference(fmt, sdtype, xdtype, m, n, k, group):
    from kernels import cpu_ops

    assert cpu_ops.load()
    qw, s, mins = _weights(fmt, n, k, group, sdtype, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(xdtype)
    ref = _ref64(x, fmt, qw, s, mins)
    y = torch.ops.ferry_cpu.wq_linear(x, qw, s, mins)
    assert y.dtype == xdtype and y.shape == (m, n)
    # fp32: only the order of the fp32 sums differs; bf16: one rounding of the output
    tol = 1e-5 if xdtype == torch.float32 else 8e-3
    assert (y.double() - ref).abs().max() <= tol * ref.abs().max()
    assert torch.allclose(wq_matmul_ref(x, fmt, qw, s, mins).double(), ref, rtol=0,
                          atol=1e-5 * ref.abs().max().item())
    w = torch.ops.ferry_cpu.wq_dequant(qw, s, mins, xdtype)
    if sdtype == torch.float16 or xdtype == torch.bfloat16:
        # an fp16 scale times a 4/8-bit integer plus an fp16 min is exact in fp32
        assert torch.equal(w, dequant(fmt, qw, s, mins, xdtype))
    else:  # fp32 scales: the C++ may fuse scale * q + min into one FMA (one rounding less)
        assert torch.allclose(w, dequant(fmt, qw, s, mins, xdtype), rtol=1e-6, atol=1e-7)


@needs_cpu_kernels
def test_cpu_kernel_refuses_bad_layouts():
    from kernels import cpu_ops

    assert cpu_ops.load()
    qw, s, mins = _weights("q4", 4, 64, 32, torch.float16, 0)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="mins"):
        torch.ops.ferry_cpu.wq_linear(x, qw, s, None)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.ferry_cpu.wq_linear(torch.randn(1, 32), qw, s, mins)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.ferry_cpu.wq_linear(x, qw, s.repeat(1, 2)[:, :4], mins.repeat(1, 2)[:, :4])


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,group", [(1, 7, 96, 32), (5, 33, 160, 32), (16, 17, 256, 128),
                                         (33, 9, 608, 32), (64, 65, 384, 128),
                                         (1, 130, 640, 128), (3, 67, 384, 64),
                                         (100, 31, 256, 128), (300, 19, 160, 32),
                                         (512, 9, 256, 128)])
def test_triton_matches_reference(fmt, xdtype, m, n, k, group):
    """Every path of ``wq_linear`` by M: split-K decode tiles (M <= 16; K=640 splits into 5
    parts, the last one partly past K), larger tiles (M <= 256, split too; tiles within one
    group of 64/128, or dequantized in registers for groups of 32), dequantize + GEMM
    (M > 256);
    K not a multiple of the 128-weight tile, odd N, fp16 and fp32 scales."""
    pytest.importorskip("triton")
    from kernels.quant.wq_triton import wq_config, wq_linear

    sdtype = torch.float32 if (m + n) % 2 else torch.float16
    qw, s, mins = _weights(fmt, n, k, group, sdtype, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(xdtype)
    ref = _ref64(x.float(), fmt, qw, s, mins)
    cfg = wq_config(m, n, k, group)
    assert cfg["BLOCK_K"] == (64 if group == 64 else 128)
    if m <= 256:  # few columns: K split over as many parts as the rule allows
        assert cfg["SPLIT_K"] == min(8 if m <= 16 else 4, -(-k // cfg["BLOCK_K"]))
    y = wq_linear(x.to(DEVICE), fmt, qw.to(DEVICE), s.to(DEVICE),
                  None if mins is None else mins.to(DEVICE))
    assert y.dtype == xdtype and y.shape == (m, n)
    # fp16: the dequantized weights (or the dequantized copy) are rounded to fp16, and the
    # output; the integer codes of a one-group tile are exact
    tol = 1e-5 if xdtype == torch.float32 else 4e-3
    assert (y.cpu().double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("split", [2, 3])
def test_triton_split_k_counters_reset(split):
    """Explicit split-K configs, twice in a row: the same result each time (the partials
    summed in K order) and the arrival counters back at 0."""
    pytest.importorskip("triton")
    from kernels.quant.wq_triton import wq_linear
    from kernels.split_k import split_k_locks

    qw, s, mins = _weights("q4", 40, 384, 128, torch.float16, seed=split)
    x = torch.randn(2, 384, generator=torch.Generator().manual_seed(9))
    ref = _ref64(x, "q4", qw, s, mins)
    cfg = dict(SPLIT_K=split, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128)
    args = [t.to(DEVICE) for t in (x, qw, s, mins)]
    y1 = wq_linear(args[0], "q4", *args[1:], config=cfg)
    y2 = wq_linear(args[0], "q4", *args[1:], config=cfg)
    assert torch.equal(y1, y2)
    assert (y1.cpu().double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert int(split_k_locks(args[0].device).abs().sum()) == 0


def test_triton_dequant_matches_reference():
    pytest.importorskip("triton")
    from kernels.quant.wq_triton import wq_dequant

    for fmt, k, group, sdtype in (("q4", 416, 32, torch.float16),
                                  ("q4", 384, 128, torch.float32),
                                  ("q8", 416, 32, torch.float16)):
        qw, s, mins = _weights(fmt, 13, k, group, sdtype, seed=group)
        w = wq_dequant(fmt, qw.to(DEVICE), s.to(DEVICE),
                       None if mins is None else mins.to(DEVICE), torch.float32)
        # fp32 scales: s * q + min may be one FMA on a device (one rounding less)
        assert torch.allclose(w.cpu(), dequant(fmt, qw, s, mins), rtol=1e-6, atol=1e-7)


def test_launch_rule_on_the_llama3_8b_shapes():
    """``wq_config`` by hand on the 8B's o_proj (4096 x 4096) and gate_up (28672 x 4096):
    decode rows past the GEMV's (M = 8) split K until ~2048 programs run, M = 64 splits o_proj's 64 tiles in 2 parts
    (~128 programs) and gives gate_up's 448 tiles 128 columns, XPU never splits."""
    pytest.importorskip("triton")
    from kernels.quant.wq_triton import wq_config

    assert wq_config(8, 4096, 4096, 128)["SPLIT_K"] == 8             # 64 blocks x 8
    assert wq_config(8, 28672, 4096, 128)["SPLIT_K"] == 4            # 448 blocks x 4
    mid = wq_config(64, 4096, 4096, 128)
    assert (mid["BLOCK_M"], mid["BLOCK_N"], mid["SPLIT_K"]) == (64, 64, 2)
    wide = wq_config(64, 28672, 4096, 128)
    assert (wide["BLOCK_N"], wide["SPLIT_K"], wide["num_warps"]) == (128, 1, 8)
    assert wq_config(1, 4096, 4096, 128, "xpu")["SPLIT_K"] == 1
    assert wq_config(64, 4096, 4096, 128, "xpu")["SPLIT_K"] == 1


@pytest.mark.skipif(DEVICE != "cpu", reason="--smoke is the CPU interpreter mode")
def test_sweep_gemm_wq_smoke():
    """``bench.kernels.sweep_gemm_wq --smoke``: the benchmark's calls, both paths (tiled
    kernel at M = 1 and 3, dequantize + GEMM at M = 300), agree with the float product."""
    pytest.importorskip("triton")
    from bench.kernels.sweep_gemm_wq import main

    rows = main(["--smoke", "--batch-sizes", "1,3,300"])["rows"]
    assert [r["path"] for r in rows] == ["kernel", "kernel", "dequant"]
    assert all(r["rel_err"] < 2e-3 for r in rows)


@pytest.mark.parametrize("act_order", [False, True])
def test_layer_triton_path_matches_the_reference_path(act_order):
    """A 4-bit ``MergedColumnLinear`` (quantized at load, groups of 64) through
    ``WeightOnlyMethod.apply``'s Triton path equals its torch reference path, also with an
    act-order activation permutation (``wq_perm``), for decode, mid and prefill row counts;
    both equal x @ W^T of the layer's dequantized weight."""
    pytest.importorskip("triton")
    from engine.layers.linear import MergedColumnLinear
    from engine.layers.quantization import quantization_scope
    from engine.layers.quantization.int4 import Int4Config

    with quantization_scope(Int4Config("awq", 64, checkpoint=False)):
        lin = MergedColumnLinear(192, [40, 40], False, torch.float32, tp_size=1, tp_rank=0)
    g = torch.Generator().manual_seed(5)
    for shard in (0, 1):
        lin.weight.weight_loader(lin.weight, torch.randn(40, 192, generator=g) * 0.05, shard)
    lin.quant_method.process_weights_after_loading(lin, "cpu")
    w = dequant("q4", lin.weight, lin.weight_scale, lin.weight_min)
    if act_order:
        perm = torch.randperm(192, generator=g)
        lin.register_buffer("wq_perm", perm, persistent=False)
        w = torch.empty_like(w).index_copy_(1, perm, w)   # W[:, perm[j]] = stored[:, j]
    xs = [torch.randn(m, 192, generator=g) for m in (1, 20, 300)]
    lin.wq_path = "torch"
    refs = [lin.quant_method.apply(lin, x) for x in xs]
    lin.to(DEVICE)
    lin.wq_path = "triton"
    for x, ref in zip(xs, refs):
        got = lin.quant_method.apply(lin, x.to(DEVICE)).cpu()
        exact = x.double() @ w.double().t()
        for y in (ref, got):
            assert y.shape == (x.shape[0], 80)
            assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
