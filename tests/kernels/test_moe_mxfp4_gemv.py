"""The GEMV-shaped MXFP4 MoE path (:mod:`kernels.moe.fused_moe_mxfp4_gemv`: gate/up + the
clamped SwiGLU in one launch, down + the weighted top-k sum in another) against the torch
reference on the dequantized experts, with gpt-oss's structure: the checkpoint's
interleaved gate/up rows de-interleaved as the loader does, biases, the clamp, top-4 of 8
experts, M = 1..4, a dropped pair; the routing inside the kernels; the dispatch by M and
the engine's two launches. fp16/fp32 in the interpreter (the path has no ``tl.dot``), bf16
at gpt-oss's shape and graph capture on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, gpu_only, rel_err

from kernels.moe import fused_moe_mxfp4 as mx_mod
from kernels.moe import fused_moe_mxfp4_gemv as gemv_mod
from kernels.moe.mxfp4 import dequantize_mxfp4
from kernels.moe.reference import fused_moe_torch, select_experts

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
#: few, wide programs: the interpreter's cost is per program
SMALL_TILES = {"up": (64, 64, 4), "down": (64, 64, 4)}


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """The checkpoint's [E, 2I, ...] rows alternating gate, up -> ferry's gate rows, then up
    rows (what ``engine.models.gpt_oss.load_gptoss_expert`` does at one rank)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], 1).contiguous()


def _case(m: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype, seed: int,
          drop: bool = False):
    """gpt-oss-shaped experts in the checkpoint's layout (interleaved gate/up blocks, scales
    and bias) and ferry's; softmax top-k routing, optionally a dropped pair (id -1).
    Returns (x, hf, ferry, weights, ids, logits): hf/ferry = (w13, s13, b13, w2, s2, b2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    w13 = torch.randint(0, 256, (num_experts, 2 * inter, hidden // 32, 16), generator=g,
                        dtype=torch.uint8)
    s13 = torch.randint(120, 125, (num_experts, 2 * inter, hidden // 32), generator=g,
                        dtype=torch.uint8)
    w2 = torch.randint(0, 256, (num_experts, hidden, inter // 32, 16), generator=g,
                       dtype=torch.uint8)
    s2 = torch.randint(120, 125, (num_experts, hidden, inter // 32), generator=g,
                       dtype=torch.uint8)
    b13 = (0.5 * torch.randn(num_experts, 2 * inter, generator=g)).to(dtype)
    b2 = (0.5 * torch.randn(num_experts, hidden, generator=g)).to(dtype)
    logits = torch.randn(m, num_experts, generator=g)
    weights, ids = select_experts(logits, top_k, True)
    if drop and m > 1:
        ids[1, 2 % top_k] = -1                # another rank's expert: contributes nothing
    hf = (w13, s13, b13, w2, s2, b2)
    ferry = (_deinterleave(w13), _deinterleave(s13), _deinterleave(b13), w2, s2, b2)
    return x, hf, ferry, weights, ids.to(torch.int32), logits


def _hf_reference(x, hf, weights, ids, alpha: float, limit: float) -> torch.Tensor:
    """transformers' ``GptOssExperts`` arithmetic on the checkpoint's layout, fp32: gate/up
    columns interleaved (``gu[..., ::2]``, ``gu[..., 1::2]``), the clamp, ``(up + 1) * glu``,
    the down bias, the routed weight."""
    w13, s13, b13, w2, s2, b2 = hf
    d13, d2 = dequantize_mxfp4(w13, s13), dequantize_mxfp4(w2, s2)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            gu = d13[e] @ x[t].float() + b13[e].float()
            gate, up = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[t] += weights[t, k] * (d2[e] @ act + b2[e].float())
    return out


def _kw(ferry, limit: float, device=DEVICE) -> dict:
    _, s13, b13, _, s2, b2 = ferry
    return dict(w13_scales=s13.to(device), w2_scales=s2.to(device), w13_bias=b13.to(device),
                w2_bias=b2.to(device), activation="swiglu_oai", swiglu_alpha=1.702,
                swiglu_limit=limit)


@pytest.mark.parametrize("m,hidden,inter,dtype,limit,tiles", [
    (1, 64, 64, F32, 7.0, None),
    (2, 96, 64, F16, 1.0, None),            # H = 96: a partial last K step (BLOCK_K 64)
    (3, 64, 96, F32, 1.0, None),            # I = 96: the down kernel's partial K step
    (4, 64, 64, F16, 7.0, None),
    (2, 64, 64, F32, 1.0, {"up": (32, 32, 1), "down": (32, 32, 2)}),  # two K steps
])
def test_gemv_matches_reference(m, hidden, inter, dtype, limit, tiles):
    """Top-4 of 8 experts with biases and the clamp; a dropped pair from M = 2; against
    ``fused_moe_torch`` on the dequantized experts (ferry's layout) and against
    transformers' arithmetic on the checkpoint's interleaved layout."""
    x, hf, ferry, weights, ids, _ = _case(m, 8, 4, hidden, inter, dtype, seed=m, drop=True)
    w13, w2 = ferry[0], ferry[3]
    kw = _kw(ferry, limit)
    out = gemv_mod.fused_moe_oai_gemv(
        x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), kw.pop("w13_scales"),
        kw.pop("w2_scales"), weights.to(DEVICE), ids.to(DEVICE), **kw,
        tiles=tiles or SMALL_TILES).cpu()
    f32 = _kw(ferry, limit, "cpu")
    f32.update(w13_bias=f32["w13_bias"].float(), w2_bias=f32["w2_bias"].float())
    ref = fused_moe_torch(x.float(), w13, w2, weights, ids, **f32)
    tol = 2e-5 if dtype == F32 else 2e-3
    assert out.dtype == dtype and rel_err(out, ref) < tol
    assert rel_err(out, _hf_reference(x, hf, weights, ids, 1.702, limit)) < tol


def test_gemv_routes_for_itself_as_fused_topk():
    """The routed variant (each program routes its token from the logits) equals
    ``fused_topk``'s ids and weights (the same arithmetic) fed to the plain one."""
    from kernels.moe.routing import fused_topk

    x, _, ferry, _, _, logits = _case(3, 8, 4, 64, 64, F32, seed=7)
    weights, ids = fused_topk(logits.to(DEVICE), 4, True)
    w13, w2 = ferry[0].to(DEVICE), ferry[3].to(DEVICE)
    kw = _kw(ferry, 7.0)
    s13, s2 = kw.pop("w13_scales"), kw.pop("w2_scales")
    x = x.to(DEVICE)
    plain = gemv_mod.fused_moe_oai_gemv(x, w13, w2, s13, s2, weights.to(DEVICE),
                                        ids.to(DEVICE), **kw, tiles=SMALL_TILES)
    routed = gemv_mod.fused_moe_oai_gemv_routed(x, w13, w2, logits.to(DEVICE), 4, True,
                                                w13_scales=s13, w2_scales=s2, **kw,
                                                tiles=SMALL_TILES)
    assert torch.equal(routed, plain)
    with pytest.raises(ValueError, match="router_logits"):
        gemv_mod.fused_moe_oai_gemv_routed(x, w13, w2, logits[:, :5].to(DEVICE), 4, True,
                                           w13_scales=s13, w2_scales=s2)
    with pytest.raises(ValueError, match="top_k"):
        gemv_mod.fused_moe_oai_gemv_routed(x, w13, w2, logits.to(DEVICE), 9, True,
                                           w13_scales=s13, w2_scales=s2)


def test_gemv_other_activations():
    """SwiGLU and GeGLU in the gate/up epilogue (the activations ``fused_moe_oai`` takes),
    no biases."""
    x, _, ferry, weights, ids, _ = _case(2, 8, 4, 64, 64, F32, seed=11)
    w13, s13, _, w2, s2, _ = ferry
    for act in ("silu", "gelu_tanh"):
        out = gemv_mod.fused_moe_oai_gemv(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE),
                                          s13.to(DEVICE), s2.to(DEVICE), weights.to(DEVICE),
                                          ids.to(DEVICE), activation=act, tiles=SMALL_TILES)
        ref = fused_moe_torch(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2,
                              activation=act)
        assert rel_err(out.cpu(), ref) < 2e-5, act


def test_fused_moe_oai_dispatches_by_m(monkeypatch):
    """``fused_moe_oai`` with MXFP4 experts and no explicit config takes the GEMV path at
    ``0 < M <= GEMV_MAX_M`` (``FERRY_MXFP4_GEMV_MAX_M``, default 4; 0: never), the grouped
    GEMM above it or with a config; ``gemv=`` forces either."""
    calls = []
    real = gemv_mod.fused_moe_oai_gemv

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs, tiles=SMALL_TILES)

    monkeypatch.setattr(mx_mod, "fused_moe_oai_gemv", spy)
    assert gemv_mod.GEMV_MAX_M == 4 or "FERRY_MXFP4_GEMV_MAX_M" in __import__("os").environ
    monkeypatch.setattr(gemv_mod, "GEMV_MAX_M", 4)
    assert gemv_mod.use_gemv_path(1) and gemv_mod.use_gemv_path(4)
    assert not gemv_mod.use_gemv_path(5) and not gemv_mod.use_gemv_path(0)
    x, _, ferry, weights, ids, _ = _case(2, 8, 4, 64, 64, F32, seed=3)
    args = (x.to(DEVICE), ferry[0].to(DEVICE), ferry[3].to(DEVICE), weights.to(DEVICE),
            ids.to(DEVICE))
    out = mx_mod.fused_moe_oai(*args, **_kw(ferry, 7.0))
    assert calls == [2]
    cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1,
               num_warps=4, num_stages=2)
    grouped = mx_mod.fused_moe_oai(*args, **_kw(ferry, 7.0), config=cfg)
    assert calls == [2] and rel_err(out, grouped) < 2e-5
    monkeypatch.setattr(gemv_mod, "GEMV_MAX_M", 0)                  # the switch off
    assert not gemv_mod.use_gemv_path(1)
    assert torch.equal(mx_mod.fused_moe_oai(*args, **_kw(ferry, 7.0), gemv=True), out)
    assert calls == [2, 2]


def test_gemv_tiles_for_gpt_oss():
    """bs1 at gpt-oss's expert shape: 720 programs a launch (>= 4 per SM of 132), 512-wide
    K steps, ~32 bytes of weights per thread a step; wider rows as M grows, up to 8 KiB of
    weights a step."""
    assert gemv_mod.gemv_tiles(1, 4, 2880, 2880, 528, 512) == {
        "up": (16, 512, 8), "down": (4, 512, 4)}
    assert gemv_mod.gemv_tiles(4, 4, 2880, 2880, 528, 512) == {
        "up": (16, 512, 8), "down": (8, 512, 8)}                # 8 KiB a step at most
    assert gemv_mod.gemv_tiles(1, 4, 2880, 2880, 528, 1024) == {
        "up": (8, 1024, 8), "down": (4, 1024, 8)}
    assert gemv_mod.gemv_tiles(1, 4, 64, 96, 528, 512) == {
        "up": (2, 64, 1), "down": (2, 128, 1)}


def test_engine_layer_takes_two_launches(monkeypatch):
    """A gpt-oss MoE block (router with bias, MXFP4 experts with biases and the clamp) on
    the Triton impl: at M <= GEMV_MAX_M the router GEMM and the two GEMV launches (with
    ``FERRY_MXFP4_GEMV_ROUTE=0`` fused_topk's launch first), the same output as the torch
    impl (the CPU path); the switch at 0 goes back to the grouped path's launches."""
    from bench.launch_count import count_launches
    from engine.layers.moe import ExpertOptions, SparseMoeBlock, triton_fused_moe

    torch.manual_seed(0)
    opts = ExpertOptions(bias=True, activation="swiglu_oai", swiglu_limit=7.0, mxfp4=True)
    block = SparseMoeBlock(32, 8, 4, 32, True, F32, router_bias=True, options=opts)
    _, _, ferry, _, _, _ = _case(1, 8, 4, 32, 32, F32, seed=5)
    ex = block.experts
    for name, t in zip(("w13_weight", "w13_scales", "w13_bias", "w2_weight", "w2_scales",
                        "w2_bias"), ferry):
        getattr(ex, name).data.copy_(t)
    block.gate.weight.data.normal_(0, 0.5)
    block.gate.bias.data.normal_(0, 0.5)         # every parameter set (torch.empty: garbage)
    assert {n for n, _ in block.named_parameters()} == {
        "gate.weight", "gate.bias", "experts.w13_weight", "experts.w13_scales",
        "experts.w13_bias", "experts.w2_weight", "experts.w2_scales", "experts.w2_bias"}
    block = block.to(DEVICE)
    x = torch.randn(1, 32).to(DEVICE)
    ref = block(x)                                             # the torch impl
    block.experts.impl = triton_fused_moe()
    monkeypatch.setattr(gemv_mod, "TARGET_PROGRAMS", 1)        # few programs: fast here
    for max_m, self_route, gemv in ((4, True, True), (4, False, True), (0, True, False)):
        monkeypatch.setattr(gemv_mod, "GEMV_MAX_M", max_m)
        monkeypatch.setattr(gemv_mod, "GEMV_SELF_ROUTE", self_route)
        with count_launches() as seen:
            out = block(x)
        names = " ".join(seen.names)
        assert ("_gemv_" in names) == gemv, seen.names
        if gemv:      # router GEMM + two (+ fused_topk's when the kernels do not route)
            assert seen.total == (3 if self_route else 4), seen.names
        assert rel_err(out, ref) < 2e-5


def test_gemv_at_gpt_oss_hidden_in_fp32():
    """One token, top-4 of 8 experts at gpt-oss's hidden size 2880 (90 scale groups a row:
    two full 1024-wide K steps and a partial one; 2880 output rows of the down kernel, not
    a multiple of its 1024-row tile), a small intermediate size (the interpreter's time),
    fp32."""
    x, _, ferry, weights, ids, _ = _case(1, 8, 4, 2880, 64, F32, seed=9)
    w13, w2 = ferry[0], ferry[3]
    kw = _kw(ferry, 7.0, "cpu")
    out = gemv_mod.fused_moe_oai_gemv(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE),
                                      kw.pop("w13_scales").to(DEVICE),
                                      kw.pop("w2_scales").to(DEVICE), weights.to(DEVICE),
                                      ids.to(DEVICE),
                                      **{k: v.to(DEVICE) if torch.is_tensor(v) else v
                                         for k, v in kw.items()},
                                      tiles={"up": (64, 1024, 4), "down": (1024, 64, 4)})
    ref = fused_moe_torch(x, w13, w2, weights, ids, **_kw(ferry, 7.0, "cpu"))
    assert rel_err(out.cpu(), ref) < 2e-5


# ------------------------------------------------------------------------------ GPU


def _check_path(m: int, num_experts: int, size: int, dtype, tol: float, tiles=None,
                config=None) -> None:
    """The GEMV path through ``fused_moe_oai(gemv=True)`` on ``fused_topk``'s routing of
    random logits: against the fp32 reference on the dequantized weights, against the
    grouped GEMM (``config``: its launch configuration, None: looked up), and the routed
    variant against it (bitwise: the same routing arithmetic)."""
    from kernels.moe.routing import fused_topk

    x, _, ferry, _, _, logits = _case(m, num_experts, 4, size, size, dtype, seed=m)
    w13, w2 = ferry[0].to(DEVICE), ferry[3].to(DEVICE)
    kw = _kw(ferry, 7.0)
    x, logits = x.to(DEVICE), logits.to(DEVICE)
    weights, ids = fused_topk(logits, 4, True)
    s13, s2 = kw.pop("w13_scales"), kw.pop("w2_scales")
    out = gemv_mod.fused_moe_oai_gemv(x, w13, w2, s13, s2, weights, ids, **kw, tiles=tiles)
    if tiles is None:                                   # the dispatch: the same call
        assert torch.equal(mx_mod.fused_moe_oai(x, w13, w2, weights, ids, w13_scales=s13,
                                                w2_scales=s2, **kw, gemv=True), out)
    f32 = dict(kw, w13_bias=kw["w13_bias"].float(), w2_bias=kw["w2_bias"].float())
    ref = fused_moe_torch(x.float(), w13, w2, weights, ids, w13_scales=s13, w2_scales=s2,
                          **f32)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < tol
    grouped = mx_mod.fused_moe_oai(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2,
                                   **kw, gemv=False, config=config)
    assert rel_err(out, grouped) < 1.6 * tol
    routed = gemv_mod.fused_moe_oai_gemv_routed(x, w13, w2, logits, 4, True,
                                                w13_scales=s13, w2_scales=s2, **kw,
                                                tiles=tiles)
    assert torch.equal(routed, out)


def test_check_path_runs_in_the_interpreter():
    """The GPU test's own code (``_check_path``) at a small shape in fp32."""
    _check_path(2, 8, 64, F32, 2e-5, tiles=SMALL_TILES,
                config=dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64,
                            GROUP_SIZE_M=1, num_warps=4, num_stages=2))


@gpu_only
@pytest.mark.parametrize("m,num_experts", [(1, 8), (2, 8), (3, 8), (4, 8), (4, 32)])
def test_gemv_bf16_at_gpt_oss_shape(m, num_experts):
    """bf16 activations at gpt-oss's expert shape (2880 x 2880, top-4 of a few experts: the
    kernels see the model's strides either way; random bytes are drawn on the host),
    default tiles and the grouped GEMM's looked-up configuration (``_check_path``)."""
    _check_path(m, num_experts, 2880, BF16, 1e-2)


@gpu_only
def test_gemv_graph_capture_and_tile_variants():
    """Captured once (no host sync, no data-dependent shape), replayed with other routes
    (one dropped pair each): the eager result; the bench's other tiles agree."""
    from engine import device as devlib

    graph_cls = devlib.graph_class(DEVICE)
    if graph_cls is None:
        pytest.skip("no device graphs here")
    x, _, ferry, weights, ids, _ = _case(2, 8, 4, 2880, 2880, BF16, seed=1, drop=True)
    w13, w2 = ferry[0].to(DEVICE), ferry[3].to(DEVICE)
    kw = _kw(ferry, 7.0)
    s13, s2 = kw.pop("w13_scales"), kw.pop("w2_scales")
    x, w_buf, id_buf = x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    out = torch.empty((2, 2880), dtype=BF16, device=DEVICE)

    def call(**extra):
        return gemv_mod.fused_moe_oai_gemv(x, w13, w2, s13, s2, w_buf, id_buf, **kw, **extra)

    stream = devlib.stream_class(DEVICE)()
    stream.wait_stream(devlib.current_stream(DEVICE))
    with devlib.stream_context(DEVICE, stream):
        call(out=out)                                          # compile outside
    devlib.current_stream(DEVICE).wait_stream(stream)
    graph = graph_cls()
    with devlib.graph_context(DEVICE, graph):
        call(out=out)
    for seed in (2, 3):
        _, _, _, weights, ids, _ = _case(2, 8, 4, 64, 64, BF16, seed=seed, drop=True)
        w_buf.copy_(weights)
        id_buf.copy_(ids)
        graph.replay()
        devlib.synchronize(DEVICE)
        eager = call()
        assert torch.equal(out, eager)
        for target, bk in ((132, 256), (264, 1024), (1056, 512)):
            tiles = gemv_mod.gemv_tiles(2, 4, 2880, 2880, target, bk)
            assert rel_err(call(tiles=tiles), eager) < 1e-2, tiles
