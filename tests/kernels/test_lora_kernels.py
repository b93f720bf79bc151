"""Batched LoRA shrink/expand (kernels/lora.py): the Triton kernels (the interpreter on the
CPU) and the torch path against a float64 loop over the requests, each with its own adapter.

Batches mix prefill segments (lengths 1-40) and decode rows (length 1), base-model rows
(slot -1), adapters of ranks 8, 16 and 64 padded into one rank-64 slot buffer, a fused
projection of three parts (q/k/v-like widths) and an adapter without the second part (its
B block is zero).
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE, GPU_MARKS, assert_close

from kernels.lora import lora_apply_triton, lora_expand, lora_shrink
from kernels.lora_torch import lora_apply_torch

K = 96
PARTS_N = (64, 32, 32)  # a fused q/k/v-like projection
RMAX = 64


def _adapters(dtype, ranks, seed):
    """Stacked slots: A [3, S, RMAX, K], B_p^T [S, RMAX, n_p]; plus each adapter's unpadded
    float64 matrices (A_p [r, K], B_p [n_p, r]) for the reference; slot 1 lacks part 1."""
    g = torch.Generator().manual_seed(seed)
    s = len(ranks)
    a = torch.zeros(3, s, RMAX, K, dtype=dtype)
    bs = [torch.zeros(s, RMAX, n, dtype=dtype) for n in PARTS_N]
    ref = []
    for slot, r in enumerate(ranks):
        mats = []
        for p, n in enumerate(PARTS_N):
            ap = (torch.randn(r, K, generator=g) / K ** 0.5).to(dtype)
            bp = (torch.randn(n, r, generator=g) / r ** 0.5).to(dtype)
            if slot == 1 and p == 1:
                bp.zero_()  # the adapter has no module here
            a[p, slot, :r] = ap
            bs[p][slot, :r] = bp.t()
            mats.append((ap.double(), bp.double()))
        ref.append(mats)
    return a, bs, ref


def _reference(x, y, segs, ref):
    out = y.double().clone()
    off = 0
    col = [0, PARTS_N[0], PARTS_N[0] + PARTS_N[1]]
    for start, n, slot in segs:
        assert start == off
        if slot >= 0:
            xs = x[start:start + n].double()
            for p, (ap, bp) in enumerate(ref[slot]):
                out[start:start + n, col[p]:col[p] + PARTS_N[p]] += xs @ ap.t() @ bp.t()
        off += n
    return out


def _batch(lens, slots, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    x = torch.randn(t, K, generator=g).to(dtype)
    y = torch.randn(t, sum(PARTS_N), generator=g).to(dtype)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return x, y, list(zip(starts, lens, slots))


CASES = [
    # (segment lengths, slots): prefill segments then decode rows, base rows mixed in
    ([17, 5, 40, 1, 1, 1, 1], [0, -1, 2, 1, -1, 0, 2]),
    ([1, 1, 1, 1, 1, 1, 1, 1], [2, 0, 1, -1, 0, 2, 1, -1]),   # a decode batch
    ([33], [1]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=GPU_MARKS)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_lora_triton_matches_loop_per_adapter(dtype, case):
    lens, slots = CASES[case]
    a, bs, ref = _adapters(dtype, ranks=(8, 16, 64), seed=case)
    x, y, segs = _batch(lens, slots, dtype, seed=10 + case)
    want = _reference(x, y, segs, ref)
    dev = torch.device(DEVICE)
    i32 = dict(dtype=torch.int32, device=dev)
    seg_start = torch.tensor([s[0] for s in segs], **i32)
    seg_len = torch.tensor([s[1] for s in segs], **i32)
    seg_slot = torch.tensor([s[2] for s in segs], **i32)
    col = [(0, 64), (64, 32), (96, 32)]
    out = y.to(dev).clone()
    lora_apply_triton(x.to(dev), out, a.to(dev), [b.to(dev) for b in bs], col, seg_start,
                      seg_len, seg_slot, max(lens))
    assert_close(out - y.to(dev), (want - y.double()).to(dev), dtype, "triton LoRA delta")
    base = [i for s0, n, sl in segs if sl < 0 for i in range(s0, s0 + n)]
    assert torch.equal(out[base].cpu(), y[base]), "base rows changed"
    # the torch path: every slot at once, a one-hot row x slot mask
    onehot = torch.zeros(len(y), len(bs[0]), dtype=dtype)
    for s0, n, sl in segs:
        if sl >= 0:
            onehot[s0:s0 + n, sl] = 1
    out_t = lora_apply_torch(x, y.clone(), a, bs, col, onehot)
    assert_close(out_t - y, want - y.double(), dtype, "torch LoRA delta")
    assert torch.equal(out_t[base], y[base]), "torch path changed base rows"


def test_lora_shrink_expand_hand_values():
    """One row, rank 2, K 3: s = A x and y += B s, computed by hand."""
    dev = torch.device(DEVICE)
    x = torch.tensor([[1.0, 2.0, 3.0]], device=dev)
    a = torch.tensor([[[[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]]], device=dev)  # [P=1, S=1, 2, 3]
    b = torch.tensor([[[2.0, 1.0], [0.0, 1.0]]], device=dev)  # B^T [1, r=2, N=2]
    one = torch.ones(1, dtype=torch.int32, device=dev)
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    s = lora_shrink(x, a, zero, one, zero, 1)
    assert s.cpu().tolist() == [[4.0, 2.0]]
    y = torch.tensor([[10.0, 20.0]], device=dev)
    lora_expand(y, s, b, zero, one, zero, 1)
    assert y.cpu().tolist() == [[18.0, 26.0]]
