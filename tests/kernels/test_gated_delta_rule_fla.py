"""FLA's gated delta rule (kernels/linear_attention/fla_ops.py, fla-core's Triton kernels)
against ferry's torch reference on the GPU at Qwen3-Next's (and Qwen3.5's) head shapes: 16
key heads and 32 value heads of 128 (grouped value heads); varlen prefill with per-request
initial states (requests shorter and longer than FLA's 64-token chunk), decode steps of many
requests at once, FLA's varlen causal conv1d with per-request states (Qwen3-Next's 8192
channels, 4 taps), and ferry's dispatch picking FLA on the GPU."""

from __future__ import annotations

import pytest
import torch

from engine.device import resolve_device
from kernels.linear_attention import (
    chunk_gated_delta_rule,
    gated_delta_rule_backend,
    recurrent_gated_delta_rule,
)
from kernels.linear_attention.reference import (
    causal_conv1d_ref,
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)

pytestmark = pytest.mark.gpu
if resolve_device("auto") != "cuda":
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("fla")

from kernels.linear_attention.fla_ops import (  # noqa: E402
    causal_conv1d_fla,
    chunk_gated_delta_rule_fla,
    recurrent_gated_delta_rule_fla,
)

HK, HV, DK, DV = 16, 32, 128, 128     # Qwen3-Next-80B-A3B / Qwen3.5-35B-A3B linear layers


def _inputs(t, b, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = rnd(t, HK, DK).to(dtype), rnd(t, HK, DK).to(dtype), rnd(t, HV, DV).to(dtype)
    g = -torch.rand(t, HV, generator=gen, device="cuda") * 0.5
    beta = torch.rand(t, HV, generator=gen, device="cuda")
    state = rnd(b, HV, DK, DV) * 0.3
    return q, k, v, g, beta, state


def test_dispatch_picks_fla_on_the_gpu():
    assert gated_delta_rule_backend("cuda") == "fla"
    assert gated_delta_rule_backend("cpu") == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_varlen_matches_reference(dtype):
    cu = [0, 70, 71, 200, 233, 297]
    q, k, v, g, beta, state = _inputs(cu[-1], len(cu) - 1, dtype)
    got, got_state = chunk_gated_delta_rule_fla(q, k, v, g, beta, initial_state=state,
                                                cu_seqlens=torch.tensor(cu, device="cuda"))
    ref, ref_state = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state,
                                                cu_seqlens=cu)
    # FLA's fp32 dots may run in TF32 (10-bit mantissa): a bug is off by O(1), not 1e-2
    tol = 1e-2 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_state, ref_state, atol=tol, rtol=tol)
    # ferry's interface runs the same kernels on a CUDA tensor (host ints accepted)
    got2, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, cu_seqlens=cu)
    torch.testing.assert_close(got2, got)
    # with the CPU twin of cu_seqlens (no host sync where fla-core takes it): the same
    twin = torch.tensor(cu, dtype=torch.int64)
    got3, state3 = chunk_gated_delta_rule_fla(q, k, v, g, beta, initial_state=state,
                                              cu_seqlens=torch.tensor(cu, device="cuda"),
                                              cu_seqlens_cpu=twin)
    torch.testing.assert_close(got3, got)
    torch.testing.assert_close(state3, got_state)


@pytest.mark.parametrize("batch", [1, 64])
def test_decode_matches_reference(batch):
    q, k, v, g, beta, state = _inputs(batch, batch, torch.float32, seed=1)
    got, got_state = recurrent_gated_delta_rule_fla(q, k, v, g, beta, initial_state=state)
    ref, ref_state = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_state, ref_state, atol=2e-3, rtol=2e-3)
    got2, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    torch.testing.assert_close(got2, got)


@pytest.mark.parametrize("cu", [[0, 2, 4, 6], [0, 3, 4, 9, 11]])
def test_recurrent_short_varlen_matches_reference(cu):
    """The speculative verify step's shape (``GatedDeltaNet`` with ``short``): a few tokens
    per request from each request's state, FLA's fused recurrent kernel over varlen runs."""
    q, k, v, g, beta, state = _inputs(cu[-1], len(cu) - 1, torch.float32, seed=2)
    got, got_state = recurrent_gated_delta_rule_fla(
        q, k, v, g, beta, initial_state=state, cu_seqlens=torch.tensor(cu, device="cuda"))
    ref, ref_state = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state,
                                                    cu_seqlens=cu)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_state, ref_state, atol=2e-3, rtol=2e-3)
    # and the chunked rule, which the verify step ran before, agrees
    chunk, _ = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state, cu_seqlens=cu)
    torch.testing.assert_close(ref, chunk, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_varlen_with_states_matches_reference(dtype):
    """FLA keeps W state columns, ferry W - 1: the wrapper's conversion, with a request of
    one token (shorter than the state) among longer ones."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    c, w = 2 * HK * DK + HV * DV, 4
    cu = [0, 70, 71, 200, 202]
    x = torch.randn(cu[-1], c, generator=gen, device="cuda").to(dtype)
    weight = (torch.randn(c, w, generator=gen, device="cuda") * 0.5).to(dtype)
    state = torch.randn(len(cu) - 1, c, w - 1, generator=gen, device="cuda").to(dtype)
    got, got_state = causal_conv1d_fla(x, weight, None, conv_state=state,
                                       cu_seqlens=torch.tensor(cu, device="cuda"))
    ref, ref_state = causal_conv1d_ref(x, weight, None, conv_state=state, cu_seqlens=cu)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got_state.float(), ref_state.float(), atol=0, rtol=0)
    got2, state2 = causal_conv1d_fla(x, weight, None, conv_state=state,
                                     cu_seqlens=torch.tensor(cu, device="cuda"),
                                     cu_seqlens_cpu=torch.tensor(cu, dtype=torch.int64))
    torch.testing.assert_close(got2, got)
    torch.testing.assert_close(state2, got_state)
