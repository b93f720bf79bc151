"""The vision towers' grouped attention (:func:`engine.models.qwen_vision.segment_attention`)
against attention written out by hand per group (softmax(q k^T / sqrt(D)) v, float64)."""

import pytest
import torch

from engine.models.qwen_vision import SegmentPlan, segment_attention


def _by_hand(q, k, v, lens):
    out, at = torch.empty_like(q, dtype=torch.float64), 0
    for n in lens:
        qs, ks, vs = (t[at:at + n].double().transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        w = torch.softmax(qs @ ks.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        out[at:at + n] = (w @ vs).transpose(0, 1)
        at += n
    return out


@pytest.mark.parametrize("lens", [
    [16, 16, 16],                 # one size: one call, no gather
    [16, 8, 16, 8, 4],            # Qwen2.5-VL's edge windows: sizes interleaved
    [4, 8, 16],                   # already sorted by size
    [5],                          # one group (a full-attention block)
])
def test_groups_attend_only_within_themselves(lens):
    g = torch.Generator().manual_seed(sum(lens))
    n, heads, dim = sum(lens), 3, 8
    q, k, v = (torch.randn(n, heads, dim, generator=g) for _ in range(3))
    plan = SegmentPlan(lens, "cpu")
    assert sum(c for _, c in plan.sizes) == len(lens)
    assert (plan.perm is None) == (lens == sorted(lens))
    got = segment_attention(q, k, v, plan)
    torch.testing.assert_close(got.double(), _by_hand(q, k, v, lens), atol=1e-5, rtol=1e-5)
