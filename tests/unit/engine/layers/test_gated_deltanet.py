"""The Gated DeltaNet layer (engine/layers/gated_deltanet.py) against HF's
``Qwen3NextGatedDeltaNet``: a varlen batch of prefills, prefill chunks carrying the state,
and decode steps through the recurrent-state pool equal HF's full-sequence forward; a
speculative verify step leaves the states as they were and its commit keeps exactly the
accepted tokens' state."""

from __future__ import annotations

import pytest
import torch

from engine.kv.state_pool import RecurrentStatePool, StateShape
from engine.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetDims, LinearStateBatch

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
from transformers import Qwen3NextConfig  # noqa: E402

HIDDEN = 32


@pytest.fixture(scope="module")
def layers():
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=8, linear_value_head_dim=6,
                          linear_conv_kernel_dim=4, num_hidden_layers=1,
                          layer_types=["linear_attention"], rms_norm_eps=1e-6)
    ref = hf.Qwen3NextGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():           # every weight matters: perturb away from init
            p.add_(torch.randn_like(p) * 0.3)
    dims = GatedDeltaNetDims(HIDDEN, 2, 4, 8, 6, 4, 1e-6)
    ours = GatedDeltaNet(dims, torch.float32)
    missing = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing.missing_keys
    return ref, ours, dims


def _pool(dims, n=4, scratch=0):
    shape = StateShape(dims.conv_dim, dims.conv_width, dims.num_v_heads, dims.k_head_dim,
                       dims.v_head_dim)
    return RecurrentStatePool(n, [shape], torch.float32, "cpu", scratch)


def _run(ours, pool, slots, pieces, decode=False):
    cu = [0]
    for p in pieces:
        cu.append(cu[-1] + p.shape[0])
    batch = LinearStateBatch(pool.conv_states[0], pool.recurrent_states[0],
                             torch.tensor(slots), cu, decode)
    with torch.no_grad():
        out = ours(torch.cat(pieces), batch)
    return [out[s:e] for s, e in zip(cu, cu[1:])]


def _hf(ref, x):
    with torch.no_grad():
        return ref(x[None])[0]


def test_varlen_prefill_matches_hf(layers):
    ref, ours, dims = layers
    pool = _pool(dims)
    xs = [torch.randn(n, HIDDEN) for n in (7, 1, 19)]
    slots = [pool.alloc() for _ in xs]
    outs = _run(ours, pool, slots, xs)
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, _hf(ref, x), atol=1e-5, rtol=1e-4)


def test_chunks_and_decode_carry_the_state(layers):
    ref, ours, dims = layers
    pool = _pool(dims)
    a, b = torch.randn(15, HIDDEN), torch.randn(9, HIDDEN)
    sa, sb = pool.alloc(), pool.alloc()
    got_a, got_b = [], []
    # chunk 1: a[:5] with b[:2]; chunk 2: a[5:12] with b[2:6]; then decode one token each
    for (a0, a1), (b0, b1) in (((0, 5), (0, 2)), ((5, 12), (2, 6))):
        oa, ob = _run(ours, pool, [sa, sb], [a[a0:a1], b[b0:b1]])
        got_a.append(oa)
        got_b.append(ob)
    for t in range(3):
        oa, ob = _run(ours, pool, [sa, sb], [a[12 + t:13 + t], b[6 + t:7 + t]], decode=True)
        got_a.append(oa)
        got_b.append(ob)
    torch.testing.assert_close(torch.cat(got_a), _hf(ref, a), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got_b), _hf(ref, b), atol=1e-5, rtol=1e-4)
    # a freed and reallocated slot starts from zero again
    pool.free(sa)
    again = pool.alloc()
    (o,) = _run(ours, pool, [again], [a[:4]])
    torch.testing.assert_close(o, _hf(ref, a[:4]), atol=1e-5, rtol=1e-4)


def test_qwen3_5_split_projections_match_hf():
    q35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    torch.manual_seed(2)
    cfg = Qwen3_5TextConfig(hidden_size=HIDDEN, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=6, linear_conv_kernel_dim=4,
                            num_hidden_layers=1, layer_types=["linear_attention"],
                            rms_norm_eps=1e-6)
    ref = q35.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    dims = GatedDeltaNetDims(HIDDEN, 2, 4, 8, 6, 4, 1e-6)
    ours = GatedDeltaNet(dims, torch.float32, split_projections=True)
    ours.load_state_dict(ref.state_dict(), strict=True)
    pool = _pool(dims)
    x = torch.randn(11, HIDDEN)
    slot = pool.alloc()
    got = _run(ours, pool, [slot], [x[:8]]) + _run(ours, pool, [slot], [x[8:9]], decode=True)
    got += _run(ours, pool, [slot], [x[9:]])
    torch.testing.assert_close(torch.cat(got), _hf(ref, x), atol=1e-5, rtol=1e-4)


def _after(ours, dims, slots, *steps):
    """A fresh pool whose ``slots`` ran ``steps`` (lists of per-request inputs) in turn;
    returns it and the last step's outputs."""
    pool = _pool(dims)
    assert [pool.alloc() for _ in slots] == slots
    out = None
    for pieces in steps:
        out = _run(ours, pool, slots, pieces)
    return pool, out


@pytest.mark.parametrize("keep", [[2, 4, 1], [1, 1, 1]])  # tokens kept, per request
def test_verify_rows_and_commit_keep_the_accepted_state(layers, keep):
    """A speculative verify step (``LinearStateBatch.verify_n`` = 4 rows a request, the third
    request's one row padded with three rows of noise): each request's own rows give an
    ordinary extend's outputs, the slots' states stay as they were, and the pool's
    ``commit`` of the state after each request's last accepted row leaves exactly the
    state of an extend over the accepted tokens only."""
    _, ours, dims = layers
    n = 4
    hist = [torch.randn(k, HIDDEN) for k in (6, 11, 3)]
    window = [torch.randn(k, HIDDEN) for k in (4, 4, 1)]   # last token + drafts
    slots = [1, 2, 3]
    pool, _ = _after(ours, dims, slots, hist)
    verify = _pool(dims, scratch=3 * n)
    for mine, theirs in zip((*verify.conv_states, *verify.recurrent_states),
                            (*pool.conv_states, *pool.recurrent_states)):
        mine[:pool.scratch_base] = theirs
    before = [t.clone() for t in (verify.conv_states[0], verify.recurrent_states[0])]
    _, plain = _after(ours, dims, slots, hist, window)
    want, _ = _after(ours, dims, slots, hist, [w[:k] for w, k in zip(window, keep)])
    rows = torch.cat([torch.cat([w, torch.randn(n - w.shape[0], HIDDEN)]) for w in window])
    batch = LinearStateBatch(verify.conv_states[0], verify.recurrent_states[0],
                             torch.tensor(slots).repeat_interleave(n),
                             list(range(3 * n + 1)), True, verify_n=n,
                             scratch_base=verify.scratch_base)
    with torch.no_grad():
        out = ours(rows, batch)
    for i, (o, w) in enumerate(zip(plain, window)):
        torch.testing.assert_close(out[i * n:i * n + w.shape[0]], o, atol=1e-5, rtol=1e-4)
    base = verify.scratch_base
    torch.testing.assert_close(verify.conv_states[0][:base], before[0][:base])   # untouched
    torch.testing.assert_close(verify.recurrent_states[0][:base], before[1][:base])
    verify.commit(slots, [base + i * n + k - 1 for i, k in enumerate(keep)])
    torch.testing.assert_close(verify.conv_states[0][:base], want.conv_states[0], atol=1e-6,
                               rtol=1e-5)
    torch.testing.assert_close(verify.recurrent_states[0][:base], want.recurrent_states[0],
                               atol=1e-5, rtol=1e-4)
