"""Fused MoE: the Triton op (interpreter on the CPU) and the torch CPU path against a float64
loop over tokens and top-k slots; the alignment against its definition; the router's
expert selection against a hand computation; the config tables; the tuner's dry run.

Routing is built to hit the edges: an expert with more pairs than a block, an expert with
exactly one pair, experts with none, top-k of 1, 2 and 8, dropped pairs (id -1). In the
interpreter a bf16 ``tl.dot`` is unreliable, so the Triton cases there are fp16/fp32; bf16,
larger shapes and graph capture run on a GPU only.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, ON_GPU, gpu_only, rel_err

from kernels.moe import moe_config
from kernels.moe.fused_moe import fused_moe, invoke_moe_gemm, moe_align_block_size, moe_sum
from kernels.moe.reference import (
    align_capacity,
    fused_moe_torch,
    moe_align_block_size_torch,
    select_experts,
)
from kernels.moe.routing import fused_topk

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
#: norm-relative error bounds vs float64: the GPU path rounds gate/up, the SwiGLU output and
#: each routed term to the activation dtype (fp16: 2^-11 each)
TOL = {F32: 1e-5, F16: 4e-3, BF16: 3e-2}


# ---------------------------------------------------------------------------- helpers


def moe_loop_ref(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The definition, one token and one slot at a time, in float64 on the CPU."""
    x, w13, w2 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    tw, ti = topk_weights.double().cpu(), topk_ids.cpu()
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for m in range(x.shape[0]):
        for k in range(ti.shape[1]):
            e = int(ti[m, k])
            if not 0 <= e < num_experts:
                continue
            gate = w13[e, :inter] @ x[m]
            up = w13[e, inter:] @ x[m]
            act = gate / (1.0 + torch.exp(-gate)) * up
            out[m] += tw[m, k] * (w2[e] @ act)
    return out


def edge_routing(m: int, num_experts: int, top_k: int, seed: int, hot: int = 40):
    """Distinct experts per token; expert 0 gets min(hot, m) pairs (more than a 16- or
    32-row block), expert 1 exactly one (token 0), expert 2 none; the rest uniformly."""
    assert num_experts - 3 >= top_k - 1
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty((m, top_k), dtype=torch.int64)
    for t in range(m):
        forced = ([0] if t < hot else []) + ([1] if t == 0 else [])
        rest = (torch.randperm(num_experts - 3, generator=g) + 3).tolist()
        row = (forced + rest)[:top_k]
        ids[t] = torch.tensor(row)[torch.randperm(top_k, generator=g)]
    # positive, not normalised, spread out: a missing weight multiply shows
    weights = torch.rand((m, top_k), generator=g) * 1.5 + 0.25
    return weights, ids


def make_weights(num_experts, hidden, inter, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn((num_experts, 2 * inter, hidden), generator=g) / math.sqrt(hidden)
    w2 = torch.randn((num_experts, hidden, inter), generator=g) / math.sqrt(inter)
    return w13.to(dtype).to(device), w2.to(dtype).to(device)


def make_x(m, hidden, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((m, hidden), generator=g) * 1.5).to(dtype).to(device)


def check(out, ref, dtype, what):
    assert out.dtype == dtype and tuple(out.shape) == tuple(ref.shape), what
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]:.3g}"
    # each token on its own (one wrong row must not hide in the norm of all rows)
    o, r = out.double().cpu(), ref.double().cpu()
    row_err = (o - r).norm(dim=1) / r.norm(dim=1).clamp_min(1e-3 * r.norm(dim=1).mean())
    worst = row_err.max().item()
    assert worst < 4 * TOL[dtype], f"{what}: worst token's relative error {worst:.3g}"


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int, outputs) -> None:
    """The outputs of the alignment against their definition (kernels.moe.fused_moe)."""
    sorted_ids, expert_ids, num_post = (t.cpu() for t in outputs)
    flat = ids.reshape(-1).cpu().long()
    num_pairs = flat.numel()
    cap = align_capacity(num_pairs, num_experts, block_m)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    assert sorted_ids.shape == (cap,) and expert_ids.shape == (cap // block_m,)
    assert cap % block_m == 0 and num_post.shape == (1,)
    counts = [int((flat == e).sum()) for e in range(num_experts)]
    post = int(num_post[0])
    assert post == sum(-(-c // block_m) * block_m for c in counts) <= cap
    used = sorted_ids[:post]
    real = used[used != num_pairs]
    # every routed pair exactly once, dropped ones never, the rest is the sentinel
    want = sorted(t for t in range(num_pairs) if 0 <= int(flat[t]) < num_experts)
    assert sorted(real.tolist()) == want
    assert (sorted_ids[post:] == num_pairs).all()
    assert ((sorted_ids >= 0) & (sorted_ids <= num_pairs)).all()
    # blocks are single-expert, in expert order, each expert's pairs ascending and first
    blocks = post // block_m
    assert (expert_ids[blocks:] == -1).all()
    prev = -1
    for b in range(blocks):
        e = int(expert_ids[b])
        assert 0 <= e < num_experts and e >= prev
        chunk = sorted_ids[b * block_m:(b + 1) * block_m]
        ok = chunk[chunk != num_pairs]
        assert all(int(flat[t]) == e for t in ok.tolist())
        prev = e
    for e in range(num_experts):
        seg = [b for b in range(blocks) if int(expert_ids[b]) == e]
        assert len(seg) == -(-counts[e] // block_m)
        if seg:
            entries = sorted_ids[seg[0] * block_m:(seg[-1] + 1) * block_m]
            pairs = [t for t in range(num_pairs) if int(flat[t]) == e]
            assert entries[:counts[e]].tolist() == pairs        # stable, then padding
            assert (entries[counts[e]:] == num_pairs).all()


# ---------------------------------------------------------------------------- router


def _fused_topk_on_device(logits, top_k, renorm):
    w, ids = fused_topk(logits.to(DEVICE), top_k, renorm)
    return w.cpu(), ids.cpu()


@pytest.mark.parametrize("route", [select_experts, _fused_topk_on_device],
                         ids=["torch", "triton"])
def test_select_experts_matches_hand_computation(route):
    logits = torch.tensor([[1.0, 3.0, 0.0, 2.0], [0.5, -1.0, 0.5, 4.0]], dtype=BF16)
    z = [[math.exp(v) for v in row] for row in logits.float().tolist()]
    p = [[v / sum(row) for v in row] for row in z]
    for renorm in (False, True):
        w, ids = route(logits, 2, renorm)
        assert w.dtype == F32 and ids.dtype == torch.int32 and w.shape == ids.shape == (2, 2)
        assert ids[0].tolist() == [1, 3] and ids[1, 0] == 3 and ids[1, 1] in (0, 2)
        for r in range(2):
            picked = [p[r][int(i)] for i in ids[r]]
            want = [v / sum(picked) for v in picked] if renorm else picked
            assert torch.allclose(w[r], torch.tensor(want), rtol=1e-6, atol=0)
    w1, ids1 = route(logits, 1, True)
    assert ids1.view(-1).tolist() == [1, 3] and torch.equal(w1, torch.ones(2, 1))
    with pytest.raises(ValueError):
        route(logits, 5, True)
    with pytest.raises(ValueError):
        route(logits[0], 1, True)


@pytest.mark.parametrize("m,num_experts,top_k,dtype,renorm", [
    (1, 8, 2, F32, True), (7, 60, 4, F16, False), (40, 128, 8, BF16, True),
    (3, 128, 1, F16, True), (5, 6, 6, F32, False)])
def test_fused_topk_matches_select_experts(m, num_experts, top_k, dtype, renorm):
    """The one-launch router against the torch one on shuffled logits (no ties): the same ids
    in the same (descending) order, weights to fp32 rounding; top_k = E takes every expert."""
    g = torch.Generator().manual_seed(m)
    # distinct per row and exact in 16 bits (multiples of 1/16 within +-4: 7 significant bits)
    logits = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(m)])
    logits = ((logits - num_experts // 2) / 16.0).to(dtype)
    w_ref, ids_ref = select_experts(logits, top_k, renorm)
    w, ids = _fused_topk_on_device(logits, top_k, renorm)
    assert w.dtype == F32 and ids.dtype == torch.int32 and w.shape == (m, top_k)
    assert torch.equal(ids, ids_ref)
    assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------- alignment


@pytest.mark.parametrize("aligner", [moe_align_block_size, moe_align_block_size_torch],
                         ids=["triton", "torch"])
@pytest.mark.parametrize("m,num_experts,top_k,block_m,dtype", [
    (1, 8, 1, 16, torch.int32),
    (1, 64, 8, 16, torch.int64),      # decode: 8 experts with one pair each
    (5, 16, 8, 32, torch.int32),
    (70, 8, 2, 16, torch.int64),      # expert 0 gets 40 pairs (three blocks)
    (300, 16, 8, 64, torch.int32),    # several chunks of pairs in the Triton alignment
])
def test_alignment_matches_definition(aligner, m, num_experts, top_k, block_m, dtype):
    _, ids = edge_routing(m, num_experts, top_k, seed=m + top_k)
    ids = ids.to(dtype).to(DEVICE)
    check_alignment(ids, num_experts, block_m, aligner(ids, block_m, num_experts))


@pytest.mark.parametrize("aligner", [moe_align_block_size, moe_align_block_size_torch],
                         ids=["triton", "torch"])
def test_alignment_drops_out_of_range_ids_and_takes_duplicates(aligner):
    ids = torch.tensor([[3, -1], [3, 3], [7, 0], [-1, 9], [0, 0]], dtype=torch.int32)
    outs = aligner(ids.to(DEVICE), 16, 8)                       # 9 >= E = 8: dropped too
    check_alignment(ids, 8, 16, outs)
    assert int(outs[2][0]) == 48                                # experts 0, 3, 7


def test_alignment_errors():
    ids = torch.zeros((2, 2), dtype=torch.int32, device=DEVICE)
    for bad in (8, 24):
        with pytest.raises(ValueError):
            moe_align_block_size(ids, bad, 4)
    with pytest.raises(ValueError):
        moe_align_block_size(ids.float(), 16, 4)


# ---------------------------------------------------------------------------- the op


_SMALL_CFG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1,
                  num_warps=4, num_stages=2)


@pytest.mark.parametrize("m,num_experts,top_k,hidden,inter,dtype,cfg", [
    (1, 4, 1, 32, 32, F32, None),                                   # top-1, one token
    (2, 8, 2, 64, 32, F16, None),
    (3, 16, 8, 32, 64, F16, None),                                  # top-8 decode
    (50, 8, 2, 48, 40, F32, dict(_SMALL_CFG, GROUP_SIZE_M=4)),      # K % BLOCK_K != 0
    (50, 8, 2, 48, 40, F16, dict(_SMALL_CFG, BLOCK_SIZE_M=32, BLOCK_SIZE_K=16)),
    (33, 16, 8, 32, 32, F16, dict(_SMALL_CFG, BLOCK_SIZE_N=16, BLOCK_SIZE_K=64)),  # K < BK
    (300, 8, 2, 32, 32, F16, None),                                 # a few hundred tokens
    (120, 16, 8, 32, 16, F32, dict(_SMALL_CFG, BLOCK_SIZE_M=64, GROUP_SIZE_M=8)),
])
def test_triton_fused_moe_matches_float64_loop(m, num_experts, top_k, hidden, inter, dtype,
                                               cfg):
    weights, ids = edge_routing(m, num_experts, top_k, seed=7 * m + top_k)
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, seed=m)
    x = make_x(m, hidden, dtype, seed=m + 1)
    ref = moe_loop_ref(x, w13, w2, weights, ids)
    ids_d, weights_d = ids.to(torch.int32).to(DEVICE), weights.to(DEVICE)
    out = fused_moe(x, w13, w2, weights_d, ids_d, config=cfg)
    check(out, ref, dtype, f"fused_moe M={m} E={num_experts} k={top_k}")
    if cfg is None and m <= 3:
        # the torch alignment gives the same result; so does a caller's out buffer
        buf = torch.full_like(out, float("nan"))
        got = fused_moe(x, w13, w2, weights_d, ids_d, out=buf, align="torch")
        assert got is buf and torch.equal(got, out)


def test_triton_fused_moe_drops_out_of_range_ids_and_adds_duplicates():
    dtype, num_experts = F32, 4
    w13, w2 = make_weights(num_experts, 32, 32, dtype, seed=3)
    x = make_x(4, 32, dtype, seed=4)
    ids = torch.tensor([[0, -1], [2, 2], [5, 1], [3, 0]], dtype=torch.int64)
    weights = torch.tensor([[0.5, 9.0], [0.25, 0.75], [9.0, 1.0], [0.3, 0.7]])
    ref = moe_loop_ref(x, w13, w2, weights, ids)
    out = fused_moe(x, w13, w2, weights.to(DEVICE), ids.to(DEVICE))
    check(out, ref, dtype, "dropped ids")
    check(fused_moe_torch(x, w13, w2, weights.to(DEVICE), ids.to(DEVICE)), ref, dtype,
          "dropped ids, torch path")


def test_moe_sum_skips_dropped_pairs_and_rounds_once():
    ids = torch.tensor([[1, -1, 0], [4, 2, 2]], dtype=torch.int32)       # E = 4: 4 dropped
    buf = torch.randn(6, 40, dtype=F16)
    buf[1] = float("nan")                                               # never read
    buf[3] = float("nan")
    out = moe_sum(buf.to(DEVICE), ids.to(DEVICE), 4, torch.empty(2, 40, dtype=F16,
                                                                   device=DEVICE))
    want = torch.stack([buf[0].float() + buf[2].float(), buf[4].float() + buf[5].float()])
    assert torch.equal(out.cpu(), want.to(F16))


def test_routed_weight_multiply_is_checked():
    """The down GEMM without its routed-weight multiply is far outside the tolerance (the
    tests above would catch a kernel that forgot it)."""
    dtype, m, num_experts, top_k = F32, 6, 8, 2
    weights, ids = edge_routing(m, num_experts, top_k, seed=11, hot=3)
    w13, w2 = make_weights(num_experts, 32, 32, dtype, seed=12)
    x = make_x(m, 32, dtype, seed=13)
    ref = moe_loop_ref(x, w13, w2, weights, ids)
    ids_d = ids.to(DEVICE)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids_d, 16, num_experts)
    gate_up = torch.empty((m * top_k, 64), dtype=dtype, device=DEVICE)
    invoke_moe_gemm(x, w13, gate_up, None, sorted_ids, expert_ids, num_post, top_k, _SMALL_CFG)
    act = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    down = torch.empty((m * top_k, 32), dtype=dtype, device=DEVICE)
    invoke_moe_gemm(act, w2, down, None, sorted_ids, expert_ids, num_post, 1, _SMALL_CFG)
    assert rel_err(down.view(m, top_k, 32).sum(1), ref) > 100 * TOL[dtype]
    unweighted = moe_loop_ref(x, w13, w2, torch.ones_like(weights), ids)
    assert rel_err(down.view(m, top_k, 32).sum(1), unweighted) < TOL[dtype]


def test_fused_moe_input_errors():
    w13, w2 = make_weights(4, 32, 16, F32, seed=1)
    x = make_x(3, 32, F32, seed=2)
    w, ids = select_experts(torch.randn(3, 4), 2, True)
    w, ids = w.to(DEVICE), ids.to(DEVICE)
    with pytest.raises(ValueError, match="shape"):
        fused_moe(x, w13, w2[:, :16], w, ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x.half(), w13, w2, w, ids)
    with pytest.raises(ValueError, match="int32/int64"):
        fused_moe(x, w13, w2, w, ids.float())
    with pytest.raises(ValueError, match="out"):
        fused_moe(x, w13, w2, w, ids, out=torch.empty(3, 16, device=DEVICE))
    with pytest.raises(ValueError, match="BLOCK_SIZE_M"):
        fused_moe(x, w13, w2, w, ids, config=dict(_SMALL_CFG, BLOCK_SIZE_M=8))
    with pytest.raises(ValueError, match="align"):
        fused_moe(x, w13, w2, w, ids, align="cub")
    empty = fused_moe(x[:0], w13, w2, w[:0], ids[:0])
    assert empty.shape == (0, 32)


# ---------------------------------------------------------------------------- CPU path


@pytest.mark.parametrize("m,num_experts,top_k,hidden,inter,dtype", [
    (1, 8, 1, 32, 32, F32),
    (9, 16, 8, 64, 48, F32),
    (257, 8, 2, 64, 32, F32),
    (40, 16, 8, 64, 32, BF16),
    (40, 8, 2, 64, 32, F16),
])
def test_cpu_path_matches_float64_loop(m, num_experts, top_k, hidden, inter, dtype):
    weights, ids = edge_routing(m, num_experts, top_k, seed=3 * m + top_k)
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, seed=m, device="cpu")
    x = make_x(m, hidden, dtype, seed=m + 1, device="cpu")
    out = fused_moe_torch(x, w13, w2, weights, ids.to(torch.int32))
    check(out, moe_loop_ref(x, w13, w2, weights, ids), dtype, f"cpu path M={m}")


# ---------------------------------------------------------------------------- configs


def test_config_table_lookup(tmp_path):
    cfg = lambda bm: dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1,
                          num_warps=4, num_stages=3)
    key = moe_config.table_key(128, 768, 2048, BF16)
    assert key == "E=128,N=768,H=2048,dtype=bf16"
    name = "NVIDIA H200"
    assert moe_config.device_config_file(name) == "NVIDIA_H200.json"
    assert moe_config.device_config_file("Intel(R) Data Center GPU Max 1550") \
        == "Intel_R_Data_Center_GPU_Max_1550.json"
    (tmp_path / "NVIDIA_H200.json").write_text(json.dumps(
        {"_meta": {"note": "ignored"}, key: {"1": cfg(16), "16": cfg(32), "256": cfg(128)}}))
    moe_config.clear_cache()
    get = lambda m, **kw: moe_config.get_moe_config(
        m, 128, 768, 2048, 8, kw.get("dtype", BF16), "cuda", kw.get("name", name),
        tmp_path)["BLOCK_SIZE_M"]
    assert [get(m) for m in (1, 3, 4, 5, 16, 63, 64, 65, 5000)] == \
        [16, 16, 32, 32, 32, 32, 128, 128, 128]          # log2-nearest, ties to the larger
    default = moe_config.default_moe_config(1, 128, 768, 2048, 8, F16, "cuda")
    assert get(1, dtype=F16) == default["BLOCK_SIZE_M"]          # no entry: the default
    assert get(1, name="Some Other GPU") == default["BLOCK_SIZE_M"]
    xpu = moe_config.default_moe_config(1, 128, 768, 2048, 8, BF16, "xpu")
    assert xpu["num_warps"] == 2 * default["num_warps"] and xpu["num_stages"] == 2
    (tmp_path / "Bad.json").write_text(json.dumps({key: {"1": dict(cfg(16), BLOCK_SIZE_N=48)}}))
    with pytest.raises(ValueError, match="BLOCK_SIZE_N"):
        moe_config.get_moe_config(1, 128, 768, 2048, 8, BF16, "cuda", "Bad", tmp_path)
    moe_config.clear_cache()


def test_shipped_tables_are_valid():
    moe_config.clear_cache()
    paths = sorted(moe_config.CONFIG_DIR.glob("*.json"))
    assert paths, "kernels/moe/moe_configs/ holds no table"
    for path in paths:
        assert moe_config.load_table(str(path)), path          # parsed and checked
    h200 = json.loads((moe_config.CONFIG_DIR / "NVIDIA_H200.json").read_text())
    key = moe_config.table_key(128, 768, 2048, BF16)
    got = moe_config.get_moe_config(3, 128, 768, 2048, 8, BF16, "cuda", "NVIDIA H200",
                                    moe_config.CONFIG_DIR)
    assert got == h200[key]["4"]                                 # 3 -> bucket 4


def test_default_configs_are_valid():
    for dtype in (BF16, F16, F32):
        for device_type in ("cuda", "xpu"):
            for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
                for e, k in ((128, 8), (8, 2)):
                    c = moe_config.default_moe_config(m, e, 768, 2048, k, dtype, device_type)
                    moe_config.check_config(c)
                    smem = c["num_stages"] * (c["BLOCK_SIZE_M"] + c["BLOCK_SIZE_N"]) \
                        * c["BLOCK_SIZE_K"] * dtype.itemsize
                    assert smem <= 160 * 1024, (dtype, device_type, m, c)


# ---------------------------------------------------------------------------- the tuner


@pytest.mark.skipif(ON_GPU, reason="--dry-run is the CPU interpreter mode")
def test_tuner_help_and_dry_run(tmp_path, capsys):
    from bench.kernels import tune_fused_moe

    with pytest.raises(SystemExit) as exc:
        tune_fused_moe.main(["--help"])
    assert exc.value.code == 0 and "--dry-run" in capsys.readouterr().out
    out = tmp_path / "table.json"
    tune_fused_moe.main(["--dry-run", "--out", str(out)])
    table = json.loads(out.read_text())
    entries = {k: v for k, v in table.items() if not k.startswith("_")}
    assert entries and all(v for v in entries.values())
    for buckets in entries.values():
        for c in buckets.values():
            moe_config.check_config(c)
    assert "MISMATCH" not in capsys.readouterr().out


# ---------------------------------------------------------------------------- GPU only


@gpu_only
@pytest.mark.parametrize("m,num_experts,top_k,hidden,inter", [
    (1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (513, 8, 2, 1024, 1792),
])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_gpu_fused_moe_model_shapes(m, num_experts, top_k, hidden, inter, dtype):
    g = torch.Generator().manual_seed(m)
    weights, ids = select_experts(torch.randn(m, num_experts, generator=g), top_k, True)
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, seed=m)
    x = make_x(m, hidden, dtype, seed=m + 1)
    # fp32 on the CPU (the loop reference in float64 is slow at these sizes)
    ref = fused_moe_torch(x.float().cpu(), w13.float().cpu(), w2.float().cpu(), weights, ids)
    out = fused_moe(x, w13, w2, weights.to(DEVICE), ids.to(DEVICE))
    check(out, ref, dtype, f"gpu M={m}")


@gpu_only
def test_gpu_fused_moe_graph_capture():
    from engine import device as devlib

    graph_cls = devlib.graph_class(DEVICE)
    if graph_cls is None:
        pytest.skip("no device graphs here")
    m, num_experts, top_k, hidden, inter, dtype = 16, 32, 4, 256, 128, BF16
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, seed=1)
    x = make_x(m, hidden, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    routes = [select_experts(torch.randn(m, num_experts, generator=g), top_k, True)
              for _ in range(3)]
    w_buf = routes[0][0].to(DEVICE)
    id_buf = routes[0][1].to(DEVICE)
    out = torch.empty((m, hidden), dtype=dtype, device=DEVICE)
    stream = devlib.stream_class(DEVICE)()
    stream.wait_stream(devlib.current_stream(DEVICE))
    with devlib.stream_context(DEVICE, stream):
        fused_moe(x, w13, w2, w_buf, id_buf, out=out)          # compile outside the capture
    devlib.current_stream(DEVICE).wait_stream(stream)
    graph = graph_cls()
    with devlib.graph_context(DEVICE, graph):
        fused_moe(x, w13, w2, w_buf, id_buf, out=out)
    for weights, ids in routes[1:]:
        w_buf.copy_(weights)
        id_buf.copy_(ids)
        graph.replay()
        devlib.synchronize(DEVICE)
        ref = fused_moe_torch(x.float().cpu(), w13.float().cpu(), w2.float().cpu(),
                              weights, ids)
        check(out, ref, dtype, "graph replay")


def test_moe_layer_with_the_triton_impl_routes_with_fused_topk():
    """``FusedMoE`` with the Triton impl (what ``select_ops`` sets on a GPU) routes with its
    one-launch router and gives the torch path's output (fp32 in the interpreter)."""
    from engine.layers.moe import FusedMoE, triton_fused_moe

    g = torch.Generator().manual_seed(3)
    layer = FusedMoE(num_experts=6, top_k=2, hidden_size=32, intermediate_size=48,
                     renormalize=True, dtype=F32)
    with torch.no_grad():
        layer.w13_weight.copy_(torch.randn(layer.w13_weight.shape, generator=g) / 6)
        layer.w2_weight.copy_(torch.randn(layer.w2_weight.shape, generator=g) / 7)
    layer = layer.to(DEVICE)
    x = torch.randn(5, 32, generator=g).to(DEVICE)
    logits = torch.randn(5, 6, generator=g).to(DEVICE)
    ref = layer(x, logits)  # the torch impl and select_experts
    layer.impl = triton_fused_moe()
    assert layer.impl.router is fused_topk
    assert rel_err(layer(x, logits), ref) < TOL[F32]


# ---------------------------------------------------------------------------- expert parallel


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [F16, F32])
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_ranks_sum_to_the_float64_loop(path, dtype, ep):
    """--ep-size: each rank runs only its E/ep experts (the other ranks' pairs localised to
    the sentinel -1 by ``localize_topk``); the ranks' outputs summed (the block's
    all-reduce) equal the float64 loop over all experts, on the Triton path (interpreter)
    and the torch path."""
    from engine.layers.moe_ep import localize_topk

    m, num_experts, top_k, hidden, inter = 37, 8, 2, 32, 32
    weights, ids = edge_routing(m, num_experts, top_k, seed=11, hot=20)
    w13, w2 = make_weights(num_experts, hidden, inter, dtype, seed=5)
    x = make_x(m, hidden, dtype, seed=6)
    ref = moe_loop_ref(x, w13, w2, weights, ids)
    n = num_experts // ep
    total = torch.zeros(ref.shape, dtype=torch.float64)
    for r in range(ep):
        lw, li = localize_topk(weights.to(DEVICE), ids.to(torch.int32).to(DEVICE), r * n, n)
        assert ((li >= 0) == ((ids >= r * n) & (ids < (r + 1) * n)).to(DEVICE)).all()
        assert (li[li < 0] == -1).all() and (lw[li < 0] == 0).all()
        w13_r, w2_r = w13[r * n:(r + 1) * n].contiguous(), w2[r * n:(r + 1) * n].contiguous()
        if path == "triton":
            part = fused_moe(x, w13_r, w2_r, lw, li, config=_SMALL_CFG)
        else:
            part = fused_moe_torch(x, w13_r, w2_r, lw, li)
        # one rank alone matches the loop restricted to its experts
        check(part, moe_loop_ref(x, w13_r, w2_r, lw, li), dtype, f"rank {r} of {ep}")
        total += part.double().cpu()
    check(total.to(dtype), ref, dtype, f"{path} ep={ep} summed over the ranks")


def test_triton_alignment_with_every_pair_on_another_rank():
    """A rank none of whose experts is routed to: the alignment is empty, the GEMMs skip
    every block and the output is exactly zero (not stale memory)."""
    ids = torch.full((5, 2), -1, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, 16, 4)
    assert int(num_post[0]) == 0 and (expert_ids == -1).all() and (sorted_ids == 10).all()
    w13, w2 = make_weights(4, 32, 32, F32, seed=1)
    x = make_x(5, 32, F32, seed=2)
    out = fused_moe(x, w13, w2, torch.zeros(5, 2, device=DEVICE), ids,
                    out=torch.full((5, 32), float("nan"), device=DEVICE))
    assert torch.equal(out, torch.zeros_like(out))
