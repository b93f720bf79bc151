"""Batched LoRA shrink/expand (kernels/lora/lora_triton.py): the Triton kernels (the interpreter
on the CPU) and the torch path against a float64 loop over the requests, each with its own adapter.

Batches mix prefill segments (lengths 1-40) and decode rows (length 1), base-model rows
(slot -1), adapters of ranks 8, 16 and 64 padded into one rank-64 slot buffer, a fused
projection of three parts (q/k/v-like widths) and an adapter without the second part (its
B block is zero).
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE, GPU_MARKS, assert_close

from kernels.lora.lora_triton import expand_tile, lora_apply_triton, lora_expand, lora_shrink
from kernels.lora.reference import lora_apply_torch

K = 96
# a fused q/k/v-like projection: part widths whose starts a 32-column tile divides (one
# expand launch), and widths no tile of 16 or more divides (one expand per part)
LAYOUTS = {"fused": (64, 32, 32), "per-part": (40, 24, 24)}
RMAX = 64


def _cols(parts_n):
    return [(sum(parts_n[:i]), n) for i, n in enumerate(parts_n)]


def _adapters(dtype, ranks, seed, parts_n):
    """Stacked slots: A [3, S, RMAX, K], B^T [S, RMAX, N] (parts side by side); plus each
    adapter's unpadded float64 matrices (A_p [r, K], B_p [n_p, r]) for the reference; slot
    1 lacks part 1."""
    g = torch.Generator().manual_seed(seed)
    s = len(ranks)
    a = torch.zeros(3, s, RMAX, K, dtype=dtype)
    b = torch.zeros(s, RMAX, sum(parts_n), dtype=dtype)
    ref = []
    for slot, r in enumerate(ranks):
        mats = []
        for p, (off, n) in enumerate(_cols(parts_n)):
            ap = (torch.randn(r, K, generator=g) / K ** 0.5).to(dtype)
            bp = (torch.randn(n, r, generator=g) / r ** 0.5).to(dtype)
            if slot == 1 and p == 1:
                bp.zero_()  # the adapter has no module here
            a[p, slot, :r] = ap
            b[slot, :r, off:off + n] = bp.t()
            mats.append((ap.double(), bp.double()))
        ref.append(mats)
    return a, b, ref


def _reference(x, y, segs, ref, parts_n):
    out = y.double().clone()
    off = 0
    for start, n, slot in segs:
        assert start == off
        if slot >= 0:
            xs = x[start:start + n].double()
            for (c, w), (ap, bp) in zip(_cols(parts_n), ref[slot]):
                out[start:start + n, c:c + w] += xs @ ap.t() @ bp.t()
        off += n
    return out


def _batch(lens, slots, dtype, seed, parts_n):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    x = torch.randn(t, K, generator=g).to(dtype)
    y = torch.randn(t, sum(parts_n), generator=g).to(dtype)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return x, y, list(zip(starts, lens, slots))


CASES = [
    # (segment lengths, slots): prefill segments then decode rows, base rows mixed in
    ([17, 5, 40, 1, 1, 1, 1], [0, -1, 2, 1, -1, 0, 2]),
    ([1, 1, 1, 1, 1, 1, 1, 1], [2, 0, 1, -1, 0, 2, 1, -1]),   # a decode batch
    ([33], [1]),
    # a decode batch of 20 rows (the one-row-segment expand: two row blocks, one all base)
    ([1] * 20, [0, 2, -1, 1, 1, 0, 2, -1, 0, 1, 2, 2, 0, -1, 1, 0] + [-1] * 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=GPU_MARKS)])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_triton_matches_loop_per_adapter(dtype, case, layout):
    parts_n = LAYOUTS[layout]
    assert (expand_tile((parts_n[0], parts_n[0] + parts_n[1])) is None) == (layout != "fused")
    lens, slots = CASES[case]
    a, b, ref = _adapters(dtype, ranks=(8, 16, 64), seed=case, parts_n=parts_n)
    x, y, segs = _batch(lens, slots, dtype, seed=10 + case, parts_n=parts_n)
    want = _reference(x, y, segs, ref, parts_n)
    dev = torch.device(DEVICE)
    i32 = dict(dtype=torch.int32, device=dev)
    seg_start = torch.tensor([s[0] for s in segs], **i32)
    seg_len = torch.tensor([s[1] for s in segs], **i32)
    seg_slot = torch.tensor([s[2] for s in segs], **i32)
    col = _cols(parts_n)
    out = y.to(dev).clone()
    lora_apply_triton(x.to(dev), out, a.to(dev), b.to(dev), col, seg_start, seg_len,
                      seg_slot, max(lens))
    assert_close(out - y.to(dev), (want - y.double()).to(dev), dtype, "triton LoRA delta")
    base = [i for s0, n, sl in segs if sl < 0 for i in range(s0, s0 + n)]
    assert torch.equal(out[base].cpu(), y[base]), "base rows changed"
    # the torch path: every slot at once, a one-hot row x slot mask
    onehot = torch.zeros(len(y), b.shape[0], dtype=dtype)
    for s0, n, sl in segs:
        if sl >= 0:
            onehot[s0:s0 + n, sl] = 1
    out_t = lora_apply_torch(x, y.clone(), a, b, col, onehot)
    assert_close(out_t - y, want - y.double(), dtype, "torch LoRA delta")
    assert torch.equal(out_t[base], y[base]), "torch path changed base rows"



# (segment lengths, slots): steps whose slots span a range [first, first + U) of the 3
# slots, one with every row on one slot (no mask), and base rows inside a range
RANGE_CASES = [
    ([1, 1, 1, 1], [1, 2, 2, 1]),       # slots 1..2 (U = 2), no base rows
    ([1, 1, 1], [2, -1, 2]),            # one slot (2) with a base row: a mask of one column
    ([5, 1, 1], [1, 1, 1]),             # every row on slot 1: no mask
    ([1], [0]),                         # bs1 on slot 0: no mask
    ([3, 1, 1, 2], [0, 2, -1, 0]),      # the full range with a gap (slot 1 unused)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(RANGE_CASES)))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("slot_major", [False, True])
def test_lora_torch_slot_range_matches_loop_per_adapter(dtype, case, layout, slot_major):
    """The torch path over only the slots a step uses (``first_slot`` and a [T, U] mask,
    or no mask when every row has the one slot), with A stored part-major (the Triton
    layout, copied) or slot-major (the CPU slots' layout, read in place), against the
    float64 loop."""
    parts_n = LAYOUTS[layout]
    lens, slots = RANGE_CASES[case]
    a, b, ref = _adapters(dtype, ranks=(8, 16, 64), seed=20 + case, parts_n=parts_n)
    if slot_major:
        a = a.transpose(0, 1).contiguous().transpose(0, 1)
    x, y, segs = _batch(lens, slots, dtype, seed=30 + case, parts_n=parts_n)
    want = _reference(x, y, segs, ref, parts_n)
    used = [sl for sl in slots if sl >= 0]
    first, u = min(used), max(used) + 1 - min(used)
    mask = None
    if u > 1 or len(used) < len(slots):
        mask = torch.zeros(len(y), u, dtype=dtype)
        for s0, n, sl in segs:
            if sl >= 0:
                mask[s0:s0 + n, sl - first] = 1
    out = lora_apply_torch(x, y.clone(), a, b, _cols(parts_n), mask, first)
    assert_close(out - y, want - y.double(), dtype, "torch LoRA delta over a slot range")
    base = [i for s0, n, sl in segs if sl < 0 for i in range(s0, s0 + n)]
    assert torch.equal(out[base], y[base]), "torch path changed base rows"

def test_lora_shrink_expand_hand_values():
    """One row, rank 2, K 3: s = A x and y += B s, computed by hand."""
    dev = torch.device(DEVICE)
    x = torch.tensor([[1.0, 2.0, 3.0]], device=dev)
    a = torch.tensor([[[[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]]], device=dev)  # [P=1, S=1, 2, 3]
    b = torch.tensor([[[2.0, 1.0], [0.0, 1.0]]], device=dev)  # B^T [1, r=2, N=2]
    one = torch.ones(1, dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    s = lora_shrink(x, a, zero, one, zero, 1)
    assert s.sum(0).cpu().tolist() == [[4.0, 2.0]]
    y = torch.tensor([[10.0, 20.0]], device=dev)
    lora_expand(y, s, b, zero, one, zero, 1)
    assert y.cpu().tolist() == [[18.0, 26.0]]


COMPILE = '''
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.lora import lora_triton as lora

def compile_one(kernel, ptrs, constexprs, arch):
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
    triton.compile(ASTSource(kernel, sig, constexprs, attrs),
                   target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "num_stages": 2})

seg = dict(seg_start_ptr="i32", seg_len_ptr="i32", seg_slot_ptr="i32")
for t, ieee in (("bf16", False), ("fp16", False), ("fp32", True)):
    for arch in (90, 80):
        compile_one(lora._shrink_kernel, dict(x_ptr=t, a_ptr=t, s_ptr="fp32", **seg),
                    dict(IEEE=ieee, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64), arch)
        compile_one(lora._expand_kernel, dict(s_ptr="fp32", b_ptr=t, y_ptr=t, **seg),
                    dict(IEEE=ieee, BLOCK_M=16, BLOCK_N=64, BLOCK_K=16), arch)
        compile_one(lora._expand_rows_kernel, dict(s_ptr="fp32", b_ptr=t, y_ptr=t,
                    seg_start_ptr="i32", seg_slot_ptr="i32"),
                    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16), arch)
        compile_one(lora._decode_fused_kernel, dict(x_ptr=t, a_ptr=t, b_ptr=t, y_ptr=t,
                    seg_start_ptr="i32", seg_slot_ptr="i32"),
                    dict(IEEE=ieee, BLOCK_M=16, BLOCK_R=16, BLOCK_K=256, BLOCK_N=64), arch)
print("COMPILED OK")
'''


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU tests compile the kernels for real")
def test_lora_kernels_compile_for_nvidia_targets():
    """The interpreter accepts programs the compiler rejects: lower both kernels through
    Triton's NVIDIA pipeline (sm_80, sm_90; bf16, fp16, fp32) in a subprocess."""
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
    res = subprocess.run([sys.executable, "-c", COMPILE], cwd=Path(__file__).parents[2],
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0 and "COMPILED OK" in res.stdout, res.stderr[-4000:]


@pytest.mark.parametrize("split_k", [2, 3, 7])
def test_lora_shrink_split_k_matches_one_chunk(split_k):
    """K in chunks of partial sums (added up) equals one program per K (K = 200:
    chunks of 64 and a short last one; 7 asks for more chunks than 64-wide ones fill)."""
    dev = torch.device(DEVICE)
    g = torch.Generator().manual_seed(3)
    k = 200
    a = torch.randn(2, 3, 16, k, generator=g).to(dev)
    x = torch.randn(9, k, generator=g).to(dev)
    i32 = dict(dtype=torch.int32, device=dev)
    segs = [torch.tensor(v, **i32) for v in ([0, 4, 5], [4, 1, 4], [2, -1, 0])]
    one = lora_shrink(x, a, *segs, 4, split_k=1)
    assert one.shape[0] == 1
    many = lora_shrink(x, a, *segs, 4, split_k=split_k)
    assert many.shape[0] == {2: 2, 3: 2, 7: 4}[split_k]  # 128-, 128- and 64-wide chunks
    one, many = one[0], many.sum(0)
    rows = [0, 1, 2, 3, 5, 6, 7, 8]  # the base segment's row (4) is not written
    ref = torch.cat([x[0:4].double() @ a[:, 2].reshape(-1, k).double().t(),
                     x[5:9].double() @ a[:, 0].reshape(-1, k).double().t()])
    assert_close(one[rows], ref, torch.float32, "shrink, one chunk")
    assert_close(many[rows], ref, torch.float32, f"shrink, split_k={split_k}")
