"""The Gated DeltaNet layer's decode steps with the fused Triton prologue
(``kernels.linear_attention.gdn_decode_prologue``, forced on here: the CPU keeps the torch
path by default) equal the unfused torch path: outputs and the whole state pool after a
prefill, a mixed step (prefill chunk + decode tail) and decode steps, slots out of order, for
Qwen3-Next's grouped projections (one key head: the gates are strided views) and Qwen3.5's
split ones. In the interpreter on the CPU, compiled on a GPU; and a tiny Qwen3.5 model's
greedy tokens with the fused prologue equal HF's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE  # noqa: E402

import engine.layers.gated_deltanet as gdn  # noqa: E402
from engine.kv.state_pool import RecurrentStatePool, StateShape  # noqa: E402
from engine.layers.gated_deltanet import (  # noqa: E402
    GatedDeltaNet,
    GatedDeltaNetDims,
    LinearStateBatch,
)

HIDDEN = 32


def _layer(split: bool, hk: int, seed: int) -> tuple[GatedDeltaNet, GatedDeltaNetDims]:
    dims = GatedDeltaNetDims(HIDDEN, hk, 2 * hk, 8, 6, 4, 1e-6)
    layer = GatedDeltaNet(dims, torch.float32, split_projections=split, tp_size=1, tp_rank=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return layer.to(DEVICE), dims


def _pool(dims: GatedDeltaNetDims) -> RecurrentStatePool:
    shape = StateShape(dims.conv_dim, dims.conv_width, dims.num_v_heads, dims.k_head_dim,
                       dims.v_head_dim)
    return RecurrentStatePool(8, [shape], torch.float32, DEVICE)


def _steps(layer, pool, fused: bool, monkeypatch) -> list[torch.Tensor]:
    """Prefill of two requests, a mixed step (a third joins while they decode), and two
    decode steps of all three; returns each step's output."""
    monkeypatch.setattr(gdn, "fused_prologue", lambda device: fused)
    calls = []
    kernel = gdn.gdn_decode_prologue
    monkeypatch.setattr(gdn, "gdn_decode_prologue",
                        lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    gen = torch.Generator().manual_seed(5)
    plan = [([5, 2], [7, 3], False, 0), ([4, 7, 5], [6, 1, 1], False, 2),
            ([4, 5, 7], [1, 1, 1], True, 0), ([7, 4, 5], [1, 1, 1], True, 0)]
    outs = []
    for slots, lens, decode, n_dec in plan:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        x = torch.randn(cu[-1], HIDDEN, generator=gen).to(DEVICE)
        batch = LinearStateBatch(pool.conv_states[0], pool.recurrent_states[0],
                                 torch.tensor(slots, device=DEVICE), cu, decode, n_dec)
        with torch.no_grad():
            outs.append(layer(x, batch))
    assert calls == ([2, 3, 3] if fused else [])     # the decode rows of steps 2-4
    return outs


@pytest.mark.parametrize("split,hk", [(False, 1), (False, 2), (True, 2)])
def test_fused_prologue_matches_the_torch_path(split, hk, monkeypatch):
    layer, dims = _layer(split, hk, seed=hk)
    pools = [_pool(dims), _pool(dims)]
    for pool in pools:
        with torch.no_grad():
            pool.conv_states[0].normal_()        # slots 1-3, 6 and 8 stay as drawn
    pools[1].conv_states[0].copy_(pools[0].conv_states[0])
    want = _steps(layer, pools[0], False, monkeypatch)
    got = _steps(layer, pools[1], True, monkeypatch)
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pools[1].conv_states[0], pools[0].conv_states[0],
                               atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pools[1].recurrent_states[0], pools[0].recurrent_states[0],
                               atol=1e-5, rtol=1e-4)


def test_switch_keeps_the_cpu_and_honours_the_env():
    assert not gdn.fused_prologue(torch.device("cpu"))
    assert gdn.fused_prologue(torch.device("cuda")) == gdn.FUSED_PROLOGUE


def test_decode_step_launches():
    """bench.launch_count's Qwen3.5 layer decode step (ferry's Triton recurrent update, as on
    a GPU): the fused prologue is one launch where the torch one gathers, convolves,
    scatters and computes the gates in a dozen."""
    from bench.launch_count import _gdn_layer

    for m in (1, 3):
        on, off = _gdn_layer(m, True), _gdn_layer(m, False)
        assert on.names["_gdn_decode_prologue_kernel"] == 1, on.names
        assert on.triton == 2 and off.triton == 1, (on.names, off.names)
        for op in ("aten.index", "aten.index_put", "aten.convolution", "aten.softplus",
                   "aten.sigmoid"):
            assert op not in on.names and op in off.names, (op, on.names)
        assert off.total - on.total >= 10, (on.total, off.total)


def test_tiny_qwen3_5_decodes_with_the_fused_prologue(tmp_path, monkeypatch):
    """A tiny random Qwen3.5 (tests/engine's: 3 Gated DeltaNet + 1 full-attention layers)
    served by the offline ``LLM`` with the fused prologue in every decode step: HF's greedy
    tokens and log-probs, in a batch and alone."""
    if DEVICE != "cpu":
        pytest.skip("the engine tests cover the GPU (the fused path is the default there)")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    try:
        from parity_helpers import SP, assert_matches_hf, hf_references, parity_llm, seeded_prompts
        from qwen3_next_helpers import save_tiny
    finally:
        sys.path.pop(0)
    prompts = seeded_prompts(high=250, lengths=(5, 13))
    ref = hf_references(save_tiny("qwen3_5", tmp_path), prompts)
    rows = []
    kernel = gdn.gdn_decode_prologue
    monkeypatch.setattr(gdn, "fused_prologue", lambda device: True)
    monkeypatch.setattr(gdn, "gdn_decode_prologue",
                        lambda *a: rows.append(a[0].shape[0]) or kernel(*a))
    with parity_llm(tmp_path) as llm:
        outs = llm.generate(prompts, SP) + llm.generate(prompts[:1], SP)
    for i, (out, r) in enumerate(zip(outs, ref + ref[:1])):
        assert_matches_hf(out, r, f"prompt {i} with the fused prologue")
    assert rows and max(rows) == 2 and min(rows) == 1, rows     # batched and alone decodes
