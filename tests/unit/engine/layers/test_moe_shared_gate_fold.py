"""The shared expert's gate folded into the router's GEMM (``SparseMoeBlock.fold_shared_gate``,
issues 45/49): on a small random fp32 block the folded forward, the unfolded one and a
hand-written reference of the unfused math agree; the fold's weight layout and views; the
paths it leaves alone (no shared gate, a router bias, the switch at 0); and the loader
folding a tiny Qwen2-MoE model, whose logits match the unfolded model's.

The HF-parity runs with the fold on are ``tests/engine/test_moe_models.py`` and
``tests/engine/test_qwen3_next.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.moe import FOLD_ROW_ALIGN, SparseMoeBlock, fold_shared_gates
from engine.loader.loader import load_model

H, E, TOP_K, INTER, SHARED_INTER = 32, 6, 2, 16, 24


class _SharedMLP(nn.Module):
    """A SwiGLU shared expert x [T, H] -> [T, H] (fp32)."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(2 * SHARED_INTER, H), requires_grad=False)
        self.down = nn.Parameter(torch.empty(H, SHARED_INTER), requires_grad=False)

    def forward(self, x):
        g, u = (x @ self.gate_up.T).chunk(2, dim=-1)
        return (F.silu(g) * u) @ self.down.T


def _block(seed: int = 0, renormalize: bool = False, **kw) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(H, E, TOP_K, INTER, renormalize, torch.float32,
                           shared_expert=_SharedMLP(), shared_expert_gate=True, **kw)
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    return block


def _reference(block: SparseMoeBlock, x: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The unfused math written out: router GEMM, softmax top-k, each token's experts, and
    ``sigmoid(x @ g^T) * shared(x)`` added."""
    logits = x @ block.gate.weight.T
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    w13, w2 = block.experts.w13_weight, block.experts.w2_weight
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t]):
            g, u = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(g) * u))
    sh = block.shared_expert
    return out + torch.sigmoid(x @ block.shared_expert_gate.weight.T) * sh(x)


@pytest.mark.parametrize("tokens,renormalize", [(1, False), (5, True), (17, False)])
def test_folded_matches_unfolded_and_the_hand_reference(tokens, renormalize):
    block = _block(renormalize=renormalize)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    ref = _reference(block, x, renormalize)
    off = block(x)
    assert block.fold_shared_gate()
    on = block(x)
    torch.testing.assert_close(off, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)


def test_fold_layout_and_views():
    block = _block()
    router = block.gate.weight.detach().clone()
    sgate = block.shared_expert_gate.weight.detach().clone()
    assert block.router_gate_weight is None
    assert block.fold_shared_gate() and block.fold_shared_gate()   # idempotent
    fused = block.router_gate_weight
    rows = -(-(E + 1) // FOLD_ROW_ALIGN) * FOLD_ROW_ALIGN
    assert fused.shape == (rows, H) and fused.dtype == torch.float32
    assert torch.equal(fused[:E], router) and torch.equal(fused[E], sgate[0])
    assert not fused[E + 1:].any()
    # the parameters are views of the folded weight (a later in-place load lands in it)
    assert block.gate.weight.data_ptr() == fused.data_ptr()
    assert block.shared_expert_gate.weight.data_ptr() == fused[E].data_ptr()
    assert not block.gate.packable and not block.shared_expert_gate.packable
    new = torch.randn(1, H)
    block.shared_expert_gate.weight_loader(block.shared_expert_gate.weight, new)
    assert torch.equal(fused[E], new[0])


def test_paths_that_stay_unfolded(monkeypatch):
    plain = SparseMoeBlock(H, E, TOP_K, INTER, True, torch.float32)
    assert not plain.fold_shared_gate() and plain.router_gate_weight is None
    ungated = SparseMoeBlock(H, E, TOP_K, INTER, True, torch.float32,
                             shared_expert=_SharedMLP())
    assert not ungated.fold_shared_gate()
    biased = SparseMoeBlock(H, E, TOP_K, INTER, True, torch.float32,
                            shared_expert=_SharedMLP(), shared_expert_gate=True,
                            router_bias=True)
    assert not biased.fold_shared_gate()
    model = nn.Sequential(_block(), _block(seed=1), plain)
    monkeypatch.setenv("FERRY_MOE_FOLD_SHARED_GATE", "0")
    assert fold_shared_gates(model) == 0
    assert all(getattr(m, "router_gate_weight", None) is None for m in model)
    monkeypatch.delenv("FERRY_MOE_FOLD_SHARED_GATE")
    assert fold_shared_gates(model) == 2


QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
             "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 256,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
             "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
             "num_experts_per_tok": 2, "shared_expert_intermediate_size": 48}


def _moe_blocks(model) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def test_loader_folds_a_qwen2_moe_model_and_the_switch_keeps_it_apart(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_MOE))
    on, _ = load_model(str(tmp_path), "dummy", dtype="float32", device="cpu", seed=5,
                       progress=False)
    monkeypatch.setenv("FERRY_MOE_FOLD_SHARED_GATE", "0")
    off, _ = load_model(str(tmp_path), "dummy", dtype="float32", device="cpu", seed=5,
                        progress=False)
    assert len(_moe_blocks(on)) == 2
    assert all(b.router_gate_weight is not None for b in _moe_blocks(on))
    assert all(b.router_gate_weight is None for b in _moe_blocks(off))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for a, b in zip(_moe_blocks(on), _moe_blocks(off)):
        torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-6)
