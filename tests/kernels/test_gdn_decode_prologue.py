"""The Gated DeltaNet decode prologue (kernels/linear_attention/decode_prologue.py) against the
torch references: ``causal_conv1d_update_ref`` on the gathered slots (written back) and the
layer's gate formulas. Slots out of order and not contiguous, channels not a multiple of the
block, conv widths 4 and 2, strided rows; the slots not in the batch stay untouched. In the
interpreter on the CPU (fp32, fp16), compiled on a GPU; the ``gpu`` test runs bf16 at
Qwen3.5-35B-A3B's shapes captured in a graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, gpu_only  # noqa: E402

from kernels.linear_attention import gdn_decode_prologue  # noqa: E402
from kernels.linear_attention.reference import causal_conv1d_update_ref  # noqa: E402


def _case(batch, channels, width, hv, slots_total, dtype, seed=0, slots=None):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(dtype).to(DEVICE)

    x = rnd(batch, channels)
    states = rnd(slots_total, channels, width - 1)
    weight = rnd(channels, width, scale=0.5)
    a, b = rnd(batch, hv, scale=4.0), rnd(batch, hv, scale=2.0)
    a[0, 0] = 30.0                                      # softplus's linear branch
    a_log, dt_bias = rnd(hv, scale=0.5), rnd(hv)
    if slots is None:
        slots = torch.randperm(slots_total - 1, generator=gen)[:batch] + 1
    return x, states, torch.as_tensor(slots).to(DEVICE), weight, a, b, a_log, dt_bias


def _reference(x, states, slots, weight, a, b, a_log, dt_bias):
    """The layer's unfused decode prologue: gather, conv update, scatter, gates."""
    conv_state = states[slots]
    out = causal_conv1d_update_ref(x, conv_state, weight, None, "silu")
    states[slots] = conv_state.to(states.dtype)
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return out, g, beta


def _check(case, dtype):
    x, states, slots, weight, a, b, a_log, dt_bias = case
    ref_states = states.clone()
    ref = _reference(x, ref_states, slots, weight, a, b, a_log, dt_bias)
    before = states.clone()
    got = gdn_decode_prologue(x, states, slots, weight, a, b, a_log, dt_bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, r, o in zip(("out", "g", "beta"), ref, got):
        assert o.dtype == r.dtype and o.shape == r.shape, name
        torch.testing.assert_close(o, r, atol=tol, rtol=tol, msg=name)
    torch.testing.assert_close(states, ref_states, atol=0, rtol=0)
    others = torch.ones(states.shape[0], dtype=torch.bool, device=states.device)
    others[slots] = False
    assert torch.equal(states[others], before[others])      # untouched, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch,channels,width,hv", [
    (1, 48, 4, 3), (3, 300, 4, 5), (5, 24, 2, 4), (2, 257, 2, 1)])
def test_prologue_matches_reference(batch, channels, width, hv, dtype):
    _check(_case(batch, channels, width, hv, 9, dtype, seed=batch), dtype)


def test_out_of_order_slots_and_strided_rows():
    dtype = torch.float32
    x, states, slots, weight, a, b, a_log, dt_bias = _case(
        3, 40, 4, 4, 12, dtype, seed=7, slots=[9, 2, 5])
    # rows of x, a and b as column slices of wider tensors (the layer's split views)
    wide = torch.randn(3, 40 + 11, dtype=dtype, device=DEVICE)
    wide[:, 3:43] = x
    ab = torch.randn(3, 8, dtype=dtype, device=DEVICE)
    ab[:, :4], ab[:, 4:] = b, a
    _check((wide[:, 3:43], states, slots, weight, ab[:, 4:], ab[:, :4], a_log, dt_bias), dtype)


def test_two_steps_advance_the_state():
    """Two consecutive tokens through the prologue equal the reference's two updates."""
    dtype = torch.float32
    x, states, slots, weight, a, b, a_log, dt_bias = _case(2, 33, 4, 2, 5, dtype, seed=3)
    ref_states = states.clone()
    for step in range(2):
        xs = x * (step + 1)
        want = _reference(xs, ref_states, slots, weight, a, b, a_log, dt_bias)[0]
        got = gdn_decode_prologue(xs, states, slots, weight, a, b, a_log, dt_bias)[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, ref_states, atol=0, rtol=0)


def test_empty_batch_and_bad_shapes():
    x, states, slots, weight, a, b, a_log, dt_bias = _case(2, 16, 4, 2, 4, torch.float32)
    out, g, beta = gdn_decode_prologue(x[:0], states, slots[:0], weight, a[:0], b[:0],
                                       a_log, dt_bias)
    assert out.shape == (0, 16) and g.shape == (0, 2) and beta.shape == (0, 2)
    with pytest.raises(ValueError, match="channels"):
        gdn_decode_prologue(x[:, :8], states, slots, weight, a, b, a_log, dt_bias)
    with pytest.raises(ValueError, match="taps"):
        gdn_decode_prologue(x, states[:, :, :2], slots, weight, a, b, a_log, dt_bias)


@gpu_only
def test_qwen35_35b_a3b_shapes_bf16_in_a_graph():
    """bf16 at Qwen3.5-35B-A3B's per-layer shapes (C = 2*16*128 + 32*128, Hv 32, W 4),
    captured once in a device graph and replayed with new inputs and slots."""
    from engine import device as devlib

    graph_cls = devlib.graph_class(DEVICE)
    if graph_cls is None:
        pytest.skip("no device graphs here")
    dtype, channels, hv = torch.bfloat16, 2 * 16 * 128 + 32 * 128, 32
    for batch in (1, 8, 64):
        _check(_case(batch, channels, 4, hv, 80, dtype, seed=batch), dtype)
    x, states, slots, weight, a, b, a_log, dt_bias = _case(4, channels, 4, hv, 16, dtype, seed=11)
    stream = devlib.stream_class(DEVICE)()
    stream.wait_stream(devlib.current_stream(DEVICE))
    with devlib.stream_context(DEVICE, stream):       # compile outside the capture
        gdn_decode_prologue(x, states.clone(), slots, weight, a, b, a_log, dt_bias)
    devlib.current_stream(DEVICE).wait_stream(stream)
    graph = graph_cls()
    with devlib.graph_context(DEVICE, graph):
        outs = gdn_decode_prologue(x, states, slots, weight, a, b, a_log, dt_bias)
    for seed in (12, 13):
        nx, ns, nslots, _, na, nb, _, _ = _case(4, channels, 4, hv, 16, dtype, seed=seed)
        x.copy_(nx)
        states.copy_(ns)
        slots.copy_(nslots)
        a.copy_(na)
        b.copy_(nb)
        ref_states = states.clone()
        want = _reference(x, ref_states, slots, weight, a, b, a_log, dt_bias)
        graph.replay()
        devlib.synchronize(DEVICE)
        for r, o in zip(want, outs):
            torch.testing.assert_close(o, r, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(states, ref_states, atol=0, rtol=0)
