"""A speculative verify step of the Gated DeltaNet kernels (``verify_n`` = n tokens a request:
``kernels/linear_attention/decode_prologue.py`` and ``decode_triton.py``) against the
torch references, and the references against the plain sequence rules: request r's n tokens
run in order from its slot, which is left as it was; the state after its token t lands in
scratch slot ``dst_base + r n + t`` and equals the state of the plain rule run over tokens
0..t from the slot's state; every other slot stays untouched, bit for bit. In the interpreter
on the CPU (fp32, fp16; bf16 is not run there), compiled on a GPU (bf16 at Qwen3.5's
shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, gpu_only  # noqa: E402

from kernels.linear_attention import gdn_decode_prologue  # noqa: E402
from kernels.linear_attention.decode_triton import (  # noqa: E402
    recurrent_gated_delta_rule_update_triton,
)
from kernels.linear_attention.reference import (  # noqa: E402
    causal_conv1d_ref,
    causal_conv1d_verify_ref,
    recurrent_gated_delta_rule_ref,
    recurrent_gated_delta_rule_verify_ref,
)


def _rule_case(reqs, n, hk, hv, dk, dv, slots_total, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen)

    rows = reqs * n
    q, k, v = rnd(rows, hk, dk).to(dtype), rnd(rows, hk, dk).to(dtype), rnd(rows, hv, dv).to(dtype)
    g = -torch.rand(rows, hv, generator=gen)
    beta = torch.rand(rows, hv, generator=gen).to(dtype)
    states = rnd(slots_total, hv, dk, dv) * 0.3
    own = torch.randperm(slots_total - rows - 1, generator=gen)[:reqs] + 1  # below scratch
    slots = own.repeat_interleave(n)          # one per row, as the step's view holds them
    return [t.to(DEVICE) for t in (q, k, v, g, beta, states, slots)]


def _check_untouched(before, after, written):
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[written] = False
    assert torch.equal(before[keep], after[keep])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_rule_reference_is_the_sequence_rule(n):
    """The verify reference against the token-by-token rule over each prefix."""
    reqs, base = 3, 9
    q, k, v, g, beta, states, slots = _rule_case(reqs, n, 2, 4, 8, 6, base + reqs * n,
                                                 torch.float32, seed=n)
    before = states.clone()
    out = recurrent_gated_delta_rule_verify_ref(q, k, v, g, beta, states, slots, n, base)
    for r in range(reqs):
        rows = slice(r * n, r * n + n)
        want, _ = recurrent_gated_delta_rule_ref(
            q[rows], k[rows], v[rows], g[rows], beta[rows],
            initial_state=before[slots[r * n]][None], cu_seqlens=[0, n])
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
        for t in range(n):
            rows_t = slice(r * n, r * n + t + 1)
            _, final = recurrent_gated_delta_rule_ref(
                q[rows_t], k[rows_t], v[rows_t], g[rows_t], beta[rows_t],
                initial_state=before[slots[r * n]][None], cu_seqlens=[0, t + 1])
            torch.testing.assert_close(states[base + r * n + t], final[0], atol=1e-5,
                                       rtol=1e-5)
    _check_untouched(before, states, torch.arange(base, base + reqs * n))


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("n,shape", [(1, (3, 2, 4, 16, 8)), (3, (2, 2, 4, 16, 8)),
                                     (2, (2, 1, 1, 8, 40))])
def test_rule_kernel_matches_reference(n, shape, l2norm):
    reqs, hk, hv, dk, dv = shape
    base = 7
    q, k, v, g, beta, states, slots = _rule_case(reqs, n, hk, hv, dk, dv,
                                                 base + reqs * n, torch.float32, seed=3)
    ref_states = states.clone()
    ref = recurrent_gated_delta_rule_verify_ref(q, k, v, g, beta, ref_states, slots, n, base,
                                                l2norm)
    got = recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, states, slots, l2norm,
                                                   verify_n=n, dst_base=base)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-4)


def test_rule_kernel_fp16_inputs():
    q, k, v, g, beta, states, slots = _rule_case(2, 3, 2, 4, 16, 8, 20, torch.float16, seed=5)
    ref_states = states.clone()
    ref = recurrent_gated_delta_rule_verify_ref(q, k, v, g, beta, ref_states, slots, 3, 14)
    got = recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, states, slots,
                                                   verify_n=3, dst_base=14)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(states, ref_states, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="requests of 4"):
        recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, states, slots, verify_n=4)


def _conv_case(reqs, n, channels, width, hv, slots_total, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(dtype).to(DEVICE)

    rows = reqs * n
    x = rnd(rows, channels)
    states = rnd(slots_total, channels, width - 1)
    weight = rnd(channels, width, scale=0.5)
    a, b = rnd(rows, hv, scale=4.0), rnd(rows, hv, scale=2.0)
    a_log, dt_bias = rnd(hv, scale=0.5), rnd(hv)
    own = torch.randperm(slots_total - rows - 1, generator=gen)[:reqs] + 1  # below scratch
    return x, states, own.repeat_interleave(n).to(DEVICE), weight, a, b, a_log, dt_bias


@pytest.mark.parametrize("n,width", [(2, 4), (4, 4), (3, 2)])
def test_conv_reference_is_the_sequence_conv(n, width):
    reqs, base = 2, 6
    x, states, slots, weight, *_ = _conv_case(reqs, n, 20, width, 2, base + reqs * n,
                                              torch.float32, seed=n)
    before = states.clone()
    out = causal_conv1d_verify_ref(x, states, slots, weight, n, base)
    for r in range(reqs):
        rows = slice(r * n, r * n + n)
        want, _ = causal_conv1d_ref(x[rows], weight, conv_state=before[slots[r * n]][None],
                                    cu_seqlens=[0, n])
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
        for t in range(n):
            _, after = causal_conv1d_ref(x[r * n:r * n + t + 1], weight,
                                         conv_state=before[slots[r * n]][None],
                                         cu_seqlens=[0, t + 1])
            torch.testing.assert_close(states[base + r * n + t], after[0], atol=0, rtol=0)
    _check_untouched(before, states, torch.arange(base, base + reqs * n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reqs,n,channels,width,hv", [
    (1, 2, 48, 4, 3), (3, 3, 300, 4, 5), (2, 4, 24, 2, 4)])
def test_prologue_kernel_matches_reference(reqs, n, channels, width, hv, dtype):
    base = 5
    x, states, slots, weight, a, b, a_log, dt_bias = _conv_case(
        reqs, n, channels, width, hv, base + reqs * n, dtype, seed=reqs + n)
    ref_states = states.clone()
    ref_out = causal_conv1d_verify_ref(x, ref_states, slots, weight, n, base)
    ref_g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    out, g, beta = gdn_decode_prologue(x, states, slots, weight, a, b, a_log, dt_bias,
                                       verify_n=n, dst_base=base)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(g, ref_g, atol=tol, rtol=tol)
    torch.testing.assert_close(beta, b.sigmoid(), atol=tol, rtol=tol)
    torch.testing.assert_close(states, ref_states, atol=0, rtol=0)


@gpu_only
def test_qwen35_shapes_bf16():
    """bf16 activations at Qwen3.5-35B-A3B's per-layer shapes (conv channels 2*16*128 +
    32*128, Hv 32 of 128 x 128), 8 requests of 2 and of 4 tokens."""
    for n in (2, 4):
        reqs, base = 8, 10
        x, states, slots, weight, a, b, a_log, dt_bias = _conv_case(
            reqs, n, 2 * 16 * 128 + 32 * 128, 4, 32, base + reqs * n, torch.bfloat16, seed=n)
        ref_states = states.clone()
        ref = causal_conv1d_verify_ref(x, ref_states, slots, weight, n, base)
        out = gdn_decode_prologue(x, states, slots, weight, a, b, a_log, dt_bias, n, base)[0]
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        q, k, v, g, beta, rs, rslots = _rule_case(reqs, n, 16, 32, 128, 128, base + reqs * n,
                                                  torch.bfloat16, seed=n)
        ref_rs = rs.clone()
        ref = recurrent_gated_delta_rule_verify_ref(q, k, v, g, beta, ref_rs, rslots, n, base)
        got = recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, rs, rslots,
                                                       verify_n=n, dst_base=base)
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(rs, ref_rs, atol=1e-3, rtol=1e-3)
