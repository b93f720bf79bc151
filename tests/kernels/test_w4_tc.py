"""The K-major 4-bit layout and its kernels (:mod:`kernels.quant.w4_tc`, issue 49) against
the torch reference (dequantize, then matmul in float64).

On the CPU the kernels run in the Triton interpreter in fp32 and fp16 (a bf16 ``tl.dot`` is
garbage there); ``gpu`` tests add bf16 and the Llama-3-8B shapes. Covered: odd M, N and K
not multiples of the tiles, groups of 32/64/128, fp16 and fp32 scales, split K, the GEMV
and the tensor-core kernel, and the layouts that reach ``q4k``: AWQ and GPTQ (quantized at
load, act-order through the layer's activation permutation) and GGUF Q4_0/Q4_1/Q4_K.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_test_utils import DEVICE, gpu_only

from kernels.quant.reference import dequant, pack_q4

triton = pytest.importorskip("triton")
from kernels.quant.w4_tc import (  # noqa: E402
    DEQUANT_MIN_M,
    from_kmajor,
    to_kmajor,
    w4k_config,
    w4k_dequant,
    w4k_linear,
)


def _weights(n, k, group, sdtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(sdtype)
    mins = (torch.randn(n, k // group, generator=g) * 0.05).to(sdtype)
    return pack_q4(q), scales, mins


def _check(x, qw, s, m, config=None, tol=None):
    """w4k_linear on the re-laid weights against x @ W^T in float64; returns y."""
    ref = x.double() @ dequant("q4", qw, s, m).double().t()
    qk, st, mt = (t.to(DEVICE) for t in to_kmajor(qw, s, m))
    y = w4k_linear(x.to(DEVICE), qk, st, mt, config=config)
    assert y.dtype == x.dtype and y.shape == ref.shape
    if tol is None:
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[x.dtype]
    err = (y.cpu().double() - ref).abs().max() / ref.abs().max()
    assert err <= tol, err
    return y


def test_kmajor_layout_by_hand():
    """Word (r, n) holds weights (n, 8r .. 8r + 7) in nibbles 0..7; scales go [K/G, N]."""
    q = torch.arange(64).remainder(16).view(2, 32)         # row 1 = row 0 (0..15, 0..15)
    q[1] = 15 - q[1]
    s, m = torch.tensor([[0.5], [2.0]]), torch.tensor([[-1.0], [1.0]])
    qk, st, mt = to_kmajor(pack_q4(q), s, m)
    assert qk.shape == (4, 2) and qk.dtype == torch.int32
    assert qk[0, 0].item() == 0x76543210
    assert qk[1, 0].item() == int.from_bytes(bytes.fromhex("fedcba98"), "big") - (1 << 32)
    assert qk[0, 1].item() == int.from_bytes(bytes.fromhex("89abcdef"), "big") - (1 << 32)
    assert torch.equal(st, s.t()) and torch.equal(mt, m.t())
    assert torch.equal(from_kmajor(qk, st, mt), dequant("q4", pack_q4(q), s, m))


@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,group", [(1, 7, 96, 32), (3, 130, 384, 128), (4, 33, 640, 64),
                                         (5, 19, 256, 128), (17, 65, 192, 64),
                                         (33, 9, 608, 32), (64, 70, 384, 128),
                                         (97, 31, 256, 128), (300, 19, 160, 32)])
def test_w4k_matches_reference(xdtype, m, n, k, group):
    """Every bucket of the table: GEMV (M <= 4), tensor-core tiles of 16..128 rows with K
    split (the last part partly past K at K = 640, 608), prefill (M = 300: dequantize + GEMM
    by default, the 128-row tiles explicitly); N and K not multiples of the tiles, fp16 and
    fp32 scales."""
    sdtype = torch.float32 if (m + n) % 2 else torch.float16
    qw, s, mins = _weights(n, k, group, sdtype, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(xdtype)
    cfg = w4k_config(m, n, k, group)
    assert cfg["GEMV"] == (m <= 4) and group % cfg["BLOCK_K"] == 0
    _check(x, qw, s, mins)
    if m > DEQUANT_MIN_M:   # the default dequantizes; the tensor-core kernel explicitly
        _check(x, qw, s, mins, config=cfg)


@pytest.mark.parametrize("group,sdtype", [(32, torch.float16), (128, torch.float32)])
def test_w4k_dequant_matches_reference(group, sdtype):
    """``w4k_dequant`` gives W^T [K, N] (N not a multiple of its 128 columns)."""
    qw, s, mins = _weights(45, 384, group, sdtype, seed=group)
    qk, st, mt = (t.to(DEVICE) for t in to_kmajor(qw, s, mins))
    wt = w4k_dequant(qk, st, mt, torch.float32)
    assert wt.shape == (384, 45)
    assert torch.allclose(wt.cpu(), dequant("q4", qw, s, mins).t(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("kernel", ["gemv", "tc", "tc-dup"])
def test_w4k_explicit_split_k_twice(split, kernel):
    """Explicit configs (the GEMV, the tensor-core kernel with either way of loading the
    words), twice: the same result (partials summed in K order) and the split-K counters
    back at 0. The GEMV at its own sizes: blocks of 4 rows (``GEMV_MAX_M``), 5 rows (the
    second block's rows past M read row M - 1); its rows are unrolled, 13.5 s a case in the
    interpreter at 18 rows in blocks of 32 (3.6 s now)."""
    from kernels.split_k import split_k_locks

    qw, s, mins = _weights(40, 384, 128, torch.float16, seed=split)
    rows, block_m = (5, 4) if kernel == "gemv" else (18, 32)
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(9))
    cfg = dict(GEMV=kernel == "gemv", SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=64)
    if kernel == "tc-dup":
        cfg["DUP_LOAD"] = True
    y1 = _check(x, qw, s, mins, config=cfg)
    y2 = _check(x, qw, s, mins, config=cfg)
    assert torch.equal(y1, y2)
    assert int(split_k_locks(torch.device(DEVICE)).abs().sum()) == 0


def test_w4k_refuses_a_tile_across_groups():
    qw, s, mins = _weights(8, 128, 32, torch.float32, seed=1)
    qk, st, mt = to_kmajor(qw, s, mins)
    with pytest.raises(ValueError, match="does not divide"):
        w4k_linear(torch.randn(20, 128), qk, st, mt,
                   config=dict(SPLIT_K=1, BLOCK_M=32, BLOCK_N=16, BLOCK_K=64))


def test_w4k_config_table_on_the_llama3_8b_shapes():
    """The table by hand: the GEMV at bs1 in 256 columns on 2 warps, 64 weights of K a tile,
    K in parts of whole tiles so that ~1024 programs run (o: 16 x 64; gate_up: 112 x 8 parts
    of 8 tiles; down: 16 x 56 parts of 4 tiles); o_proj at M = 16 in 8 parts (64 tiles -> 512
    programs), at M = 64 in 64 x 64 tiles, K in 4 parts (64 tiles -> 256 programs); gate_up
    at M = 64 unsplit (448 tiles); prefill 128 x 128 tiles of 64 weights of K; XPU never
    splits."""
    one = w4k_config(1, 4096, 4096, 128)
    assert (one["GEMV"], one["BLOCK_M"], one["SPLIT_K"]) == (True, 1, 64)
    assert (one["BLOCK_N"], one["BLOCK_K"], one["num_warps"]) == (256, 64, 2)
    assert w4k_config(1, 28672, 4096, 128)["SPLIT_K"] == 8
    assert w4k_config(1, 4096, 14336, 128)["SPLIT_K"] == 56
    assert w4k_config(3, 4096, 4096, 128)["BLOCK_M"] == 4
    assert w4k_config(2, 4096, 4096, 32)["BLOCK_K"] == 32
    assert w4k_config(16, 4096, 4096, 128)["SPLIT_K"] == 8
    assert w4k_config(16, 28672, 4096, 128)["SPLIT_K"] == 1
    mid = w4k_config(64, 4096, 4096, 128)
    assert (mid["BLOCK_M"], mid["BLOCK_N"], mid["SPLIT_K"]) == (64, 64, 4)
    assert w4k_config(64, 28672, 4096, 128)["SPLIT_K"] == 1
    assert w4k_config(20, 6144, 4096, 128)["BLOCK_M"] == 32
    pre = w4k_config(512, 4096, 14336, 128)
    assert (pre["BLOCK_M"], pre["BLOCK_N"], pre["BLOCK_K"], pre["SPLIT_K"]) == (128, 128, 64, 1)
    assert w4k_config(64, 4096, 4096, 128, "xpu")["SPLIT_K"] == 1
    assert w4k_config(16, 4096, 4096, 32)["BLOCK_K"] == 32


@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", False), ("gptq", True)])
def test_layer_kmajor_path_matches_the_reference_path(monkeypatch, method, act_order):
    """AWQ/GPTQ layers quantized at load (groups of 64), re-laid by the layer with
    ``FERRY_WQ_LAYOUT=kmajor``, act-order through ``wq_perm``: decode, mid and prefill row
    counts equal the torch reference path."""
    from engine.layers.linear import MergedColumnLinear
    from engine.layers.quantization import quantization_scope
    from engine.layers.quantization.int4 import Int4Config

    monkeypatch.setenv("FERRY_WQ_LAYOUT", "kmajor")
    with quantization_scope(Int4Config(method, 64, checkpoint=False)):
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
    lin.quant_method._to_kmajor(lin)
    assert lin.wq_format == "q4k" and lin.weight.shape == (192 // 8, 80)
    for x, ref in zip(xs, refs):
        got = lin.quant_method.apply(lin, x.to(DEVICE)).cpu()
        exact = x.double() @ w.double().t()
        for y in (ref, got):
            assert y.shape == (x.shape[0], 80)
            assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def _gguf_blocks(ggml_type, n, k, seed):
    from engine.layers.quantization.gguf import BLOCK_TYPES, BLOCK_WEIGHTS

    rng = np.random.default_rng(seed)
    per = BLOCK_WEIGHTS.get(ggml_type, 32)
    nbytes = BLOCK_TYPES[ggml_type][1]
    raw = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)
    halves = 1 if ggml_type == 2 else 2                    # Q4_0: d; Q4_1: d, m; Q4_K: d, dmin
    scales = (rng.standard_normal((n, k // per, halves)) * 0.02).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(n, k // per, 2 * halves)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("ggml_type", [2, 3, 12])                     # Q4_0, Q4_1, Q4_K
@pytest.mark.parametrize("m", [3, 21])
def test_gguf_q4_blocks_through_kmajor(ggml_type, m):
    """GGUF Q4 blocks (fp16 scales for Q4_0/Q4_1, fp32 for Q4_K; groups of 32) repacked as
    the loader does, then re-laid: the GEMV and the tensor-core kernel match the blocks'
    own dequantization (gguf-py) times x."""
    gguf = pytest.importorskip("gguf")
    from engine.layers.quantization.gguf import GgufBlocks, repack

    n, k = 37, 512
    raw = _gguf_blocks(ggml_type, n, k, seed=ggml_type + m)
    packed = repack(GgufBlocks(raw, ggml_type, (n, k)))
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)))
    assert torch.equal(dequant("q4", packed["weight"], packed["weight_scale"],
                               packed["weight_min"]), w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    _check(x, packed["weight"], packed["weight_scale"], packed["weight_min"])


@gpu_only
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 16, 17, 64, 100, 256, 512])
def test_w4k_gpu_llama3_shapes(xdtype, m):
    """On a GPU: the 8B's o_proj (4096 x 4096) and a 14336-wide down_proj slice, AWQ-style
    fp32 scales and mins in groups of 128, bf16 and fp16 activations, every bucket."""
    for n, k in ((4096, 4096), (1024, 14336)):
        qw, s, mins = _weights(n, k, 128, torch.float32, seed=m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(xdtype)
        _check(x, qw, s, mins, tol=2e-2 if xdtype == torch.bfloat16 else 3e-3)


@gpu_only
def test_w4k_gpu_graph_replay():
    """Captured in a CUDA/XPU graph (split-K counters reset by the kernel): replays give the
    eager result."""
    from engine import device as devlib

    qw, s, mins = _weights(4096, 4096, 128, torch.float32, seed=0)
    qk, st, mt = (t.to(DEVICE) for t in to_kmajor(qw, s, mins))
    for m in (1, 32):
        x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
        eager = w4k_linear(x, qk, st, mt)
        devlib.synchronize(DEVICE)
        g = devlib.graph_class(DEVICE)()
        with devlib.graph_context(DEVICE, g):
            y = w4k_linear(x, qk, st, mt)
        for _ in range(3):
            g.replay()
        devlib.synchronize(DEVICE)
        assert torch.equal(y, eager)


@pytest.mark.skipif(DEVICE != "cpu", reason="--smoke is the CPU interpreter mode")
def test_bench_w4_smoke():
    """``bench.kernels.bench_w4 --smoke``: the old and new calls agree with the product."""
    from bench.kernels.bench_w4 import main

    rows = main(["--smoke", "--batch-sizes", "1,20"])["rows"]
    assert all(r["old"] < 2e-3 and r["new"] < 2e-3 for r in rows)


GEMV_COMPILE = '''
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.quant import w4_tc

def lower(xt, m, split, arch, pairs):
    kern = w4_tc._w4k_gemv_kernel
    ptrs = dict(x_ptr=xt, qk_ptr="i32", s_ptr="fp32", m_ptr="fp32", y_ptr=xt, part_ptr="fp32",
                lock_ptr="i32")
    cfg = w4_tc.w4k_config(m, 4096, 4096, 128)
    consts = dict(GROUP=128, SPLIT_K=split, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  BLOCK_K=cfg["BLOCK_K"], X_BF16=pairs)
    sig, attrs = {}, {}
    for i, name in enumerate(kern.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:   # N, K and the strides of the 8B's shapes: the JIT sees them divisible by 16
            sig[name] = "i32"
            if name in ("N", "K", "k_per_split", "stride_xm", "stride_ym"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    out = triton.compile(ASTSource(kern, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                         options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    # the tile's every word row in each thread: no layout conversion through shared memory
    # in the K loop (the first version's 3-D accumulator took 64 barriers a tile); the
    # epilogue's store and split-K sum have a few
    bars = out.asm["ptx"].count("bar.sync")
    assert bars <= 4, (xt, m, bars)
    assert "ld.global.v4.b32" in out.asm["ptx"] or "ld.global.v4.u32" in out.asm["ptx"]

lower("bf16", 1, 64, 90, True)
lower("bf16", 4, 8, 90, True)
lower("fp16", 2, 1, 80, False)
lower("fp32", 1, 4, 90, False)

def lower_tc(xt, m, arch):
    kern = w4_tc._w4k_tc_kernel
    ptrs = dict(x_ptr=xt, qk_ptr="i32", s_ptr="fp32", m_ptr="fp32", y_ptr=xt, part_ptr="fp32",
                lock_ptr="i32")
    cfg = w4_tc.w4k_config(m, 4096, 4096, 128)
    consts = dict(IEEE=xt == "fp32", SPLIT_K=cfg["SPLIT_K"], BLOCK_M=cfg["BLOCK_M"],
                  BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], DUP_LOAD=False)
    sig, attrs = {}, {}
    for i, name in enumerate(kern.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name in ("N", "K", "G", "k_per_split", "stride_xm", "stride_ym"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    out = triton.compile(ASTSource(kern, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                         options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    # the unpacked codes reach the MMA's staging as vectors (the reshape-unpacked first
    # version stored them one 16-bit element at a time: 64 st.shared.b16 a tile)
    assert "st.shared.b16" not in out.asm["ptx"] and "st.shared.u16" not in out.asm["ptx"], (xt, m)

lower_tc("bf16", 16, 90)
lower_tc("bf16", 64, 90)
lower_tc("fp16", 32, 80)
print("COMPILED OK")
'''


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU tests compile the kernels for real")
def test_w4k_kernels_compile_for_nvidia_targets():
    """The interpreter accepts programs the compiler rejects: lower the GEMV the table picks
    (1, 2 and 4 rows; bf16 x read as int32 pairs, fp16, fp32) and the tensor-core kernel (16,
    32, 64 rows) for sm_90/sm_80 in a subprocess; the GEMV keeps its tile in registers (no
    shared-memory conversions in its loop), the tensor-core kernel stages its codes as
    vectors."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-c", GEMV_COMPILE], cwd=Path(__file__).parents[2],
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode == 0 and "COMPILED OK" in res.stdout, res.stderr[-4000:]
