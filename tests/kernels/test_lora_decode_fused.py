"""The one-launch LoRA decode kernel (``kernels.lora.lora_triton.lora_decode_fused``) against
the float64 loop per adapter and against the two-launch shrink/expand path: decode batches
mixing adapters of ranks 8, 16 and 64 (padded into rank-64 or rank-16 slots), base rows,
fused projections of 1, 2 and 3 parts (widths a tile divides or not), several row blocks.
fp32/fp16 in the interpreter (bf16 on a GPU), and the launch count.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICE, GPU_MARKS, assert_close
from test_lora_kernels import K, _batch, _cols, _reference

from kernels.lora import lora_triton
from kernels.lora.lora_triton import lora_apply_triton, lora_decode_fused

DECODE_CASES = [
    [0],                                          # bs1 on one adapter
    [-1],                                         # bs1 base row: nothing changes
    [2, 0, 1, -1, 0, 2, 1, -1],                   # mixed adapters and base rows
    [1] * 5,                                      # every row on one slot
    [(i * 7) % 4 - 1 for i in range(70)],         # two row blocks of 64
]
PARTS = {"qkv": (64, 32, 32), "odd": (40, 24, 24), "gate_up": (48, 48), "down": (80,)}


def _slots_of(dtype, ranks, rmax, parts_n, seed):
    """A [P, S, rmax, K], B [S, rmax, N] with adapter ``slot`` of rank ``ranks[slot]`` (the
    rows past it zero) and the float64 matrices for the reference."""
    g = torch.Generator().manual_seed(seed)
    p_num, s = len(parts_n), len(ranks)
    a = torch.zeros(p_num, s, rmax, K, dtype=dtype)
    b = torch.zeros(s, rmax, sum(parts_n), dtype=dtype)
    ref = []
    for slot, r in enumerate(ranks):
        mats = []
        for p, (off, n) in enumerate(_cols(parts_n)):
            ap = (torch.randn(r, K, generator=g) / K ** 0.5).to(dtype)
            bp = (torch.randn(n, r, generator=g) / r ** 0.5).to(dtype)
            a[p, slot, :r] = ap
            b[slot, :r, off:off + n] = bp.t()
            mats.append((ap.double(), bp.double()))
        ref.append(mats)
    return a, b, ref


def _run(x, y, a, b, parts_n, slots, fused, monkeypatch):
    dev = torch.device(DEVICE)
    g = len(slots)
    i32 = dict(dtype=torch.int32, device=dev)
    monkeypatch.setattr(lora_triton, "FUSED_DECODE", fused)
    out = y.to(dev).clone()
    lora_apply_triton(x.to(dev), out, a.to(dev), b.to(dev), _cols(parts_n),
                      torch.arange(g, **i32), torch.ones(g, **i32),
                      torch.tensor(slots, **i32), 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=GPU_MARKS)])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
@pytest.mark.parametrize("layout", list(PARTS))
def test_fused_decode_matches_loop_and_two_launch_path(dtype, case, layout, monkeypatch):
    slots = DECODE_CASES[case]
    parts_n = PARTS[layout]
    ranks, rmax = ((8, 16, 64), 64) if case % 2 == 0 else ((16, 8, 16), 16)
    a, b, ref = _slots_of(dtype, ranks, rmax, parts_n, seed=case)
    x, y, segs = _batch([1] * len(slots), slots, dtype, seed=50 + case, parts_n=parts_n)
    want = _reference(x, y, segs, ref, parts_n)
    out = _run(x, y, a, b, parts_n, slots, True, monkeypatch)
    if all(sl < 0 for sl in slots):
        assert torch.equal(out.cpu(), y), "a batch of base rows changed"
        return
    assert_close(out - y.to(out.device), (want - y.double()).to(out.device), dtype,
                 "fused decode LoRA delta")
    base = [i for i, sl in enumerate(slots) if sl < 0]
    assert torch.equal(out[base].cpu(), y[base]), "base rows changed"
    two = _run(x, y, a, b, parts_n, slots, False, monkeypatch)
    assert_close(out - y.to(out.device), (two - y.to(out.device)).double(), dtype,
                 "fused against two launches")


def test_fused_decode_hand_values():
    """One row, rank 2, K 3: y += B (A x)."""
    dev = torch.device(DEVICE)
    x = torch.tensor([[1.0, 2.0, 3.0]], device=dev)
    a = torch.tensor([[[[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]]], device=dev)  # [P=1, S=1, 2, 3]
    b = torch.tensor([[[2.0, 1.0], [0.0, 1.0]]], device=dev)               # [S=1, r=2, N=2]
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    y = torch.tensor([[10.0, 20.0]], device=dev)
    lora_decode_fused(x, y, a, b, [(0, 2)], zero, zero)
    assert y.cpu().tolist() == [[18.0, 26.0]]


def test_fused_decode_refuses_four_parts_and_apply_falls_back(monkeypatch):
    parts_n = (16, 16, 16, 16)
    dev = torch.device(DEVICE)
    a, b, ref = _slots_of(torch.float32, (8, 16), 16, parts_n, seed=9)
    x, y, segs = _batch([1, 1, 1], [1, -1, 0], torch.float32, seed=9, parts_n=parts_n)
    zero = torch.zeros(3, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="at most 3 parts"):
        lora_decode_fused(x.to(dev), y.to(dev), a.to(dev), b.to(dev), _cols(parts_n), zero,
                          zero)
    out = _run(x, y, a, b, parts_n, [1, -1, 0], True, monkeypatch)   # the two-launch path
    want = _reference(x, y, segs, ref, parts_n)
    assert_close(out - y.to(dev), (want - y.double()).to(dev), torch.float32, "4 parts")


def test_fused_decode_is_one_launch_a_projection(monkeypatch):
    from bench.launch_count import count_launches

    parts_n = PARTS["qkv"]
    a, b, _ = _slots_of(torch.float32, (8, 16), 16, parts_n, seed=1)
    x, y, _ = _batch([1] * 4, [0, 1, -1, 0], torch.float32, seed=2, parts_n=parts_n)
    for fused, want in ((True, 1), (False, 2)):
        with count_launches() as seen:
            _run(x, y, a, b, parts_n, [0, 1, -1, 0], fused, monkeypatch)
        assert seen.triton == want, seen.names


def test_fused_decode_keeps_two_launches_past_max_k(monkeypatch):
    """A projection whose K exceeds FUSED_MAX_K (each fused program walks all of K) keeps
    the split-K shrink and the expand."""
    from bench.launch_count import count_launches

    parts_n = PARTS["down"]
    a, b, _ = _slots_of(torch.float32, (8, 16), 16, parts_n, seed=1)
    x, y, _ = _batch([1] * 3, [0, 1, -1], torch.float32, seed=2, parts_n=parts_n)
    for max_k, want in ((K, 1), (K - 1, 2)):
        monkeypatch.setattr(lora_triton, "FUSED_MAX_K", max_k)
        with count_launches() as seen:
            _run(x, y, a, b, parts_n, [0, 1, -1], True, monkeypatch)
        assert seen.triton == want, seen.names
