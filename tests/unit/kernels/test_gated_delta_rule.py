"""The torch gated delta rule and causal conv1d (kernels/linear_attention) against transformers'
``qwen3_next`` functions: chunked and recurrent, varlen with per-request initial states."""

from __future__ import annotations

import pytest
import torch

from kernels.linear_attention import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

HK, HV, DK, DV = 2, 4, 8, 6


def _inputs(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, HK, DK, generator=gen)
    k = torch.randn(t, HK, DK, generator=gen)
    v = torch.randn(t, HV, DV, generator=gen)
    g = -torch.rand(t, HV, generator=gen) * 0.5
    beta = torch.rand(t, HV, generator=gen)
    state = torch.randn(len(lengths), HV, DK, DV, generator=gen) * 0.3
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, g, beta, state, cu


def _hf_per_request(fn, q, k, v, g, beta, state, cu, **kw):
    outs, finals = [], []
    for b, (s, e) in enumerate(zip(cu, cu[1:])):
        o, f = fn(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                  initial_state=None if state is None else state[b:b + 1],
                  output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        outs.append(o[0])
        finals.append(f[0])
    return torch.cat(outs), torch.stack(finals)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 64])
def test_chunk_matches_hf_varlen(with_state, chunk_size):
    q, k, v, g, beta, state, cu = _inputs([5, 1, 13, 8])
    init = state if with_state else None
    out, final = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init,
                                            cu_seqlens=torch.tensor(cu), chunk_size=chunk_size)
    ref_o, ref_f = _hf_per_request(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, init, cu,
                                   chunk_size=chunk_size)
    torch.testing.assert_close(out, ref_o, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_f, atol=1e-5, rtol=1e-4)


def test_recurrent_matches_hf_and_chunk():
    q, k, v, g, beta, state, cu = _inputs([3, 7, 1])
    out, final = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state,
                                                cu_seqlens=cu)
    ref_o, ref_f = _hf_per_request(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta,
                                   state, cu)
    torch.testing.assert_close(out, ref_o, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_f, atol=1e-5, rtol=1e-4)
    c_out, c_final = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state,
                                                cu_seqlens=cu, chunk_size=4)
    torch.testing.assert_close(c_out, out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(c_final, final, atol=1e-5, rtol=1e-4)


def test_decode_step_one_token_per_request_and_prefill_split():
    """A prefill split in two (state carried) then decode steps equal one long prefill."""
    q, k, v, g, beta, _, _ = _inputs([12], seed=3)
    whole, whole_final = chunk_gated_delta_rule_ref(q, k, v, g, beta, chunk_size=4)
    head, state = chunk_gated_delta_rule_ref(q[:7], k[:7], v[:7], g[:7], beta[:7], chunk_size=4)
    tail, state = chunk_gated_delta_rule_ref(q[7:10], k[7:10], v[7:10], g[7:10], beta[7:10],
                                             initial_state=state, chunk_size=4)
    steps = []
    for t in (10, 11):
        o, state = recurrent_gated_delta_rule_ref(q[t:t + 1], k[t:t + 1], v[t:t + 1],
                                                  g[t:t + 1], beta[t:t + 1], initial_state=state)
        steps.append(o)
    torch.testing.assert_close(torch.cat([head, tail, *steps]), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, whole_final, atol=1e-5, rtol=1e-4)


def test_dtype_and_errors():
    q, k, v, g, beta, state, cu = _inputs([4])
    out, final = chunk_gated_delta_rule_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens=[0, 3])
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule_ref(q, k, v[:, :3], g[:, :3], beta[:, :3])


C, W = 10, 4


def _conv(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(C, W, generator=gen), torch.randn(C, generator=gen)


@pytest.mark.parametrize("bias", [False, True])
def test_conv_prefill_matches_hf_fresh_and_continued(bias):
    weight, b = _conv()
    b = b if bias else None
    lengths = [6, 1, 2]
    cu = [0, 6, 7, 9]
    x = torch.randn(9, C)
    out, state = causal_conv1d_ref(x, weight, b, cu_seqlens=cu)
    for i, (s, e) in enumerate(zip(cu, cu[1:])):
        ref = hf.causal_conv1d_fn(x[None, s:e].transpose(1, 2), weight, b, activation="silu")
        torch.testing.assert_close(out[s:e], ref[0].t())
        padded = torch.nn.functional.pad(x[s:e].t(), (W - 1, 0))
        torch.testing.assert_close(state[i], padded[:, -(W - 1):])
    # continuing from a state: HF's cached prefill convolves the state then the new inputs
    x2 = torch.randn(5, C)
    prior = torch.randn(3, C, W - 1)
    out2, state2 = causal_conv1d_ref(x2, weight, b, conv_state=prior, cu_seqlens=[0, 2, 3, 5])
    for i, (s, e) in enumerate(zip([0, 2, 3], [2, 3, 5])):
        full = torch.cat([prior[i], x2[s:e].t()], dim=-1)
        ref = hf.causal_conv1d_fn(full[None], weight, b, activation="silu")[0, :, -(e - s):]
        torch.testing.assert_close(out2[s:e], ref.t())
        torch.testing.assert_close(state2[i], full[:, -(W - 1):])
    assert len(lengths) == state.shape[0]


def test_conv_update_matches_hf_and_prefill():
    weight, b = _conv(2)
    x = torch.randn(3, C)
    hf_state = torch.randn(3, C, W)                     # HF keeps W inputs; the oldest is unused
    ours = hf_state[:, :, 1:].clone()
    ref = hf.causal_conv1d_update(x.unsqueeze(-1), hf_state, weight, b, "silu")
    out = causal_conv1d_update_ref(x, ours, weight, b, "silu")
    torch.testing.assert_close(out, ref[:, :, 0])
    torch.testing.assert_close(ours, hf_state[:, :, 1:])
    # a one-token prefill from the same state gives the same
    ours2 = hf_state[:, :, :-1].clone()
    prior = ours2.clone()
    o1 = causal_conv1d_update_ref(x, ours2, weight, b, None)
    o2, s2 = causal_conv1d_ref(x, weight, b, conv_state=prior, cu_seqlens=[0, 1, 2, 3],
                               activation=None)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(ours2, s2)


def test_batched_decode_step_equals_the_per_request_recurrence():
    """One token for each of B requests: the batched step (``cu_seqlens`` None, B rows of
    state) equals the per-request loop over the same tokens."""
    from kernels.linear_attention.reference import recurrent_gated_delta_rule_ref

    g0 = torch.Generator().manual_seed(3)
    b, hk, hv, dk, dv = 5, 2, 4, 8, 6
    q, k = torch.randn(b, hk, dk, generator=g0), torch.randn(b, hk, dk, generator=g0)
    v = torch.randn(b, hv, dv, generator=g0)
    g = -torch.rand(b, hv, generator=g0)
    beta = torch.rand(b, hv, generator=g0)
    state = torch.randn(b, hv, dk, dv, generator=g0)
    out, final = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state)
    loop_out, loop_final = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state,
                                                          cu_seqlens=list(range(b + 1)))
    torch.testing.assert_close(out, loop_out)
    torch.testing.assert_close(final, loop_final)
