"""ferry's C++ CPU kernels (kernels/cpu/ops.cpp) and oneDNN-prepacked linear weights, against
float64 computations of the same math (never against their own output)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import device as devmod
from engine.layers.linear import linear, pack_linear_weight
from kernels import cpu_ops

NO_COMPILER = shutil.which("g++") is None and shutil.which("c++") is None
pytestmark = pytest.mark.skipif(
    NO_COMPILER or os.environ.get("FERRY_CPU_KERNELS") == "0",
    reason="no C++ compiler (or FERRY_CPU_KERNELS=0): the CPU runs the torch references")

# bf16 outputs carry one rounding of ~2^-8 relative; the fp32 math inside is exact enough
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def test_kernels_build():
    """Where a compiler exists the build must succeed (else every CPU test below would
    silently fall back to the references)."""
    assert cpu_ops.load() is True
    assert hasattr(torch.ops.ferry_cpu, "decode_attention")


def _decode_ref64(q, kb, vb, r2t, rows, lens, scale):
    """Per-request float64 attention over req_to_token's slots (GQA by head repetition)."""
    bsz, hq, d = q.shape
    group = hq // kb.shape[1]
    out = torch.empty(bsz, hq, d, dtype=torch.float64)
    for b in range(bsz):
        slots = r2t[rows[b], :lens[b]].long()
        k = kb[slots].double().repeat_interleave(group, 1)        # [L, Hq, D]
        v = vb[slots].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("bsz,hq,hkv,d,max_len", [
    (1, 9, 3, 64, 40),      # SmolLM2's heads, one request (per-head tasks)
    (12, 8, 2, 128, 70),    # whole-request tasks (bsz >= 4 * threads)
    (5, 4, 4, 40, 33),      # D not a multiple of 16: the scalar loops
    (3, 6, 1, 16, 1),       # multi-query, a one-token context
    (10, 6, 3, 64, 37),     # group 2, whole requests
    (2, 2, 2, 64, 6),       # group 1 (MHA), a short context
])
# bf16 on AVX512-BF16 CPUs runs the vdpbf16ps task unless FERRY_CPU_BF16_DOT=0
@pytest.mark.parametrize("dtype,bf16_dot", [(torch.float32, "1"), (torch.bfloat16, "1"),
                                            (torch.bfloat16, "0")])
def test_decode_attention_matches_float64(dtype, bsz, hq, hkv, d, max_len, bf16_dot,
                                          monkeypatch):
    monkeypatch.setenv("FERRY_CPU_BF16_DOT", bf16_dot)
    assert cpu_ops.load()
    g = torch.Generator().manual_seed(bsz * 100 + d)
    slots = 3 * bsz * max_len + 7
    kb = torch.randn(slots, hkv, d, generator=g).to(dtype)
    vb = torch.randn(slots, hkv, d, generator=g).to(dtype)
    r2t = torch.zeros(bsz + 2, max_len + 5, dtype=torch.int32)
    perm = torch.randperm(slots - 1, generator=g) + 1          # scattered, like a used pool
    for i in range(bsz + 2):
        r2t[i, :max_len] = perm[i * max_len:(i + 1) * max_len].int()
    rows = torch.randperm(bsz + 2, generator=g)[:bsz].long()
    lens = torch.randint(1, max_len + 1, (bsz,), generator=g).long()
    lens[0] = max_len
    # q as a strided view of a wider buffer (the qkv output's layout)
    qbuf = torch.randn(bsz, hq * d + 3 * d, generator=g).to(dtype)
    q = qbuf[:, :hq * d].view(bsz, hq, d)
    o = torch.full((bsz, hq, d), float("nan"), dtype=dtype)
    scale = d ** -0.5
    cpu_ops.decode_attention(q, kb, vb, o, r2t, rows, lens, scale)
    ref = _decode_ref64(q, kb, vb, r2t, rows, lens, scale)
    assert torch.allclose(o.double(), ref, rtol=TOL[dtype], atol=TOL[dtype]), \
        (o.double() - ref).abs().max()


def test_decode_attention_rejects_mismatched_dtypes():
    assert cpu_ops.load()
    q = torch.randn(1, 2, 16)
    kb = torch.randn(4, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_ops.decode_attention(q, kb, kb, torch.empty_like(q), torch.zeros(1, 4, dtype=torch.int32),
                                 torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_float64(dtype, with_residual):
    assert cpu_ops.load()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 576, generator=g).to(dtype)
    res = torch.randn(37, 576, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    got = cpu_ops.rms_norm(x, w, 1e-5, res)
    s = x if res is None else (x.double() + res.double()).to(dtype)   # the rounded sum
    ref = w.double() * s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    out = got if res is None else got[0]
    assert torch.allclose(out.double(), ref, rtol=2 * TOL[dtype], atol=2 * TOL[dtype])
    if res is not None:
        assert torch.equal(got[1], s)            # the new residual is the rounded sum
    assert out.dtype == dtype and out.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_float64(dtype):
    assert cpu_ops.load()
    g = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(19, 2 * 300, generator=g)).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.0])     # exp's clamps
    got = cpu_ops.silu_and_mul(x)
    xd = x.double()
    ref = F.silu(xd[:, :300]) * xd[:, 300:]
    assert torch.allclose(got.double(), ref, rtol=2 * TOL[dtype], atol=2 * TOL[dtype])
    assert got.shape == (19, 300) and got.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_float64_in_place(dtype):
    assert cpu_ops.load()
    from engine.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(3)
    d, hq, hkv, t = 64, 9, 3, 23
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    before = qkv.clone()
    pos = torch.randint(0, 4000, (t,), generator=g)
    cache = RotaryEmbedding(d, 4096, 10000.0).cos_sin_cache
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hkv) * d]
    cpu_ops.rotary_inplace(q, k, pos, cache, d)
    # the table's own (fp32) cos/sin values, in float64: the kernel's math is under test
    cs = cache.double()[pos]
    cos, sin = cs[:, None, :d // 2], cs[:, None, d // 2:]
    for got, src in ((q, before[:, :hq * d]), (k, before[:, hq * d:(hq + hkv) * d])):
        x = src.double().view(t, -1, d)
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        ref = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).view(t, -1)
        assert torch.allclose(got.double(), ref, rtol=2 * TOL[dtype], atol=2 * TOL[dtype])
    assert torch.equal(qkv[:, (hq + hkv) * d:], before[:, (hq + hkv) * d:])   # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_prepacked_linear_matches_float64(dtype, rows):
    if not devmod.cpu_packed_gemm(dtype):
        pytest.skip(f"no oneDNN prepacked GEMM for {dtype} on this CPU")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    packed = pack_linear_weight(w)
    assert packed.is_mkldnn and packed.numel() == w.numel()
    ref = x.double() @ w.double().t() + b.double()
    got = linear(x, packed, b)
    # 80-term sums of N(0,1) products: |ref| ~ 9; fp32 accumulation either way
    atol = 1e-3 if dtype == torch.float32 else 0.25
    assert got.dtype == dtype and got.shape == (rows, 96)
    assert torch.allclose(got.double(), ref, rtol=TOL[dtype], atol=atol)
    assert torch.allclose(linear(x, w, b).double(), ref, rtol=TOL[dtype], atol=atol)


def test_a_killed_builds_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    # torch's cpp_extension.load waits forever on build_dir/lock; a killed build leaves it
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not cpu_ops.clear_stale_lock(tmp_path)            # a build in progress: kept
    assert lock.exists()
    old = time.time() - cpu_ops.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert cpu_ops.clear_stale_lock(tmp_path)                # a killed build's: removed
    assert not lock.exists()
    assert not cpu_ops.clear_stale_lock(tmp_path)            # none: nothing to do
