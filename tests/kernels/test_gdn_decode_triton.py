"""ferry's Triton decode step of the gated delta rule (kernels/linear_attention/decode_triton.py)
against the torch reference: each request's slot of the state pool updated in place, the
other slots untouched, grouped value heads, with and without the q/k L2 norm. In the
interpreter on the CPU (small heads), compiled on a GPU (also Qwen3-Next's 16/32 heads of
128, 64 requests)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, GPU_MARKS  # noqa: E402

from kernels.linear_attention.decode_triton import (  # noqa: E402
    recurrent_gated_delta_rule_update_triton,
)
from kernels.linear_attention.reference import (  # noqa: E402
    recurrent_gated_delta_rule_ref,
    recurrent_gated_delta_rule_update_ref,
)


def _case(b, hk, hv, dk, dv, slots_total, dtype, seed=0):
    g0 = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=g0)

    q, k, v = rnd(b, hk, dk).to(dtype), rnd(b, hk, dk).to(dtype), rnd(b, hv, dv).to(dtype)
    g = -torch.rand(b, hv, generator=g0)
    beta = torch.rand(b, hv, generator=g0).to(dtype)
    states = rnd(slots_total, hv, dk, dv) * 0.3
    slots = torch.randperm(slots_total - 1, generator=g0)[:b] + 1
    return [t.to(DEVICE) for t in (q, k, v, g, beta, states, slots)]


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("shape", [(3, 2, 4, 16, 8), (2, 1, 1, 8, 40)])
def test_decode_update_matches_reference(shape, l2norm):
    b, hk, hv, dk, dv = shape
    q, k, v, g, beta, states, slots = _case(b, hk, hv, dk, dv, 6, torch.float32)
    before = states.clone()
    ref_states = states.clone()
    ref = recurrent_gated_delta_rule_update_ref(q, k, v, g, beta, ref_states, slots, l2norm)
    got = recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, states, slots, l2norm)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-4)   # others untouched
    # the same as the plain recurrence from the slots' states
    out, final = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=before[slots],
                                                use_qk_l2norm=l2norm)
    torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states[slots], final, atol=1e-5, rtol=1e-4)


def test_decode_update_reads_column_slices_in_place():
    """q, k, v as the layer passes them: column slices of one conv output row [B, C] (row
    stride C), read without a copy; the result equals the contiguous inputs' reference."""
    b, hk, hv, dk, dv = 3, 2, 4, 16, 8
    q, k, v, g, beta, states, slots = _case(b, hk, hv, dk, dv, 6, torch.float32, seed=3)
    packed = torch.cat([q.reshape(b, -1), k.reshape(b, -1), v.reshape(b, -1)], dim=1)
    qs, ks, vs = torch.split(packed, [hk * dk, hk * dk, hv * dv], dim=1)
    qs, ks, vs = qs.reshape(b, hk, dk), ks.reshape(b, hk, dk), vs.reshape(b, hv, dv)
    assert not qs.is_contiguous() and qs.stride(0) == packed.shape[1]
    ref_states = states.clone()
    ref = recurrent_gated_delta_rule_update_ref(q, k, v, g, beta, ref_states, slots, True)
    got = recurrent_gated_delta_rule_update_triton(qs, ks, vs, g, beta, states, slots, True)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@GPU_MARKS[0]
@GPU_MARKS[1]
def test_qwen3_next_shapes_on_the_gpu(dtype):
    q, k, v, g, beta, states, slots = _case(64, 16, 32, 128, 128, 80, dtype, seed=1)
    ref_states = states.clone()
    ref = recurrent_gated_delta_rule_update_ref(q, k, v, g, beta, ref_states, slots)
    got = recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, states, slots)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(states, ref_states, atol=1e-4, rtol=1e-4)
