"""``MLAttention`` through the Triton MLA backend (``engine/attention/triton_mla.py``, the GPU
path: MHA-form extend, absorbed decode) against the same layer's torch path, step by step
over two identical latent pools: a prefill, a chunk after a prefix with a fresh prefill
beside it, a mixed step (a chunk plus decode rows), decodes eager and through the graph
metadata (static split counts and workspaces). Over an FP8 latent pool (e4m3, the layer's
``kv_scale`` 1 and not) the two paths read the same stored rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, gpu_only

from engine.attention import create_attention_backend
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kv.pool import ReqToTokenPool, build_kv_pool
from engine.layers.mla import MLAttention, mla_softmax_scale
from engine.layers.rotary import RotaryEmbedding

EXT, DEC = ForwardMode.EXTEND, ForwardMode.DECODE


def make_layer(h, r, n, p, v, hid, dtype, seed=0):
    torch.manual_seed(seed)
    layer = MLAttention(hid, h, 12, r, n, p, v, 0, RotaryEmbedding(p, 4096, 10000.0), 1e-6,
                        dtype, mla_softmax_scale(n + p, None))
    for prm in layer.parameters():
        # 0.3 on the tiny layers; 1/sqrt(fan-in) on wide ones, so that the scores of the
        # real head shape stay O(1) and bf16 rounding does not flip a near-one-hot softmax
        std = 1.0 if prm.ndim == 1 else (0.3 if prm.shape[1] <= 64 else prm.shape[1] ** -0.5)
        prm.data.copy_(torch.randn_like(prm) * std + (prm.ndim == 1))
    return layer.to(DEVICE)


class Stepper:
    """One latent pool and request table; ``step`` builds the ForwardBatch as the engine does
    (extending requests first, one-token decode rows last)."""

    def __init__(self, layer, dtype, backend=None, kv_dtype=None):
        self.pool = build_kv_pool([layer.spec], 4096, 16, kv_dtype or dtype, DEVICE)
        self.r2t = ReqToTokenPool(8, 2048, DEVICE)
        self.rows, self.pages, self.lens = {}, {}, {}
        self.backend = backend

    def step(self, layer, mode, reqs, nd=0, graph=False):
        rows, pos, locs, seq, ext = [], [], [], [], []
        for rid, n in reqs:
            if rid not in self.rows:
                self.rows[rid], self.pages[rid], self.lens[rid] = self.r2t.alloc(), [], 0
            cur = self.lens[rid]
            slots = self.pool.grow(self.pages[rid], cur, n)
            self.r2t.req_to_token[self.rows[rid], cur:cur + n] = torch.tensor(slots,
                                                                              device=DEVICE)
            rows.append(self.rows[rid])
            pos += range(cur, cur + n)
            locs += slots
            seq.append(cur + n)
            ext.append(n)
            self.lens[rid] = cur + n
        t = lambda x, d=torch.int64: torch.tensor(x, dtype=d, device=DEVICE)  # noqa: E731
        fb = ForwardBatch(mode=mode, batch_size=len(reqs), positions=t(pos),
                          req_pool_indices=t(rows), seq_lens=t(seq, torch.int32),
                          out_cache_loc=t(locs), req_to_token=self.r2t.req_to_token,
                          k_buffers=self.pool.k_buffers, v_buffers=self.pool.v_buffers,
                          attn_backend=self.backend, seq_lens_cpu=seq,
                          extend_seq_lens_cpu=[] if mode == DEC else ext,
                          extend_seq_lens=t(ext, torch.int32),
                          extend_start_loc=t([sum(ext[:i]) for i in range(len(ext))],
                                             torch.int32),
                          max_extend_len=max(ext), num_decodes=nd)
        if self.backend is not None:
            if graph:
                self.backend.init_capture(8)
                self.backend.init_forward_graph(fb)
            else:
                self.backend.init_forward(fb)
        return fb


#: (mode, [(request, new tokens)], decode rows at the end, through the graph metadata)
STEPS = [
    (EXT, [("a", 20)], 0, False),                            # prefill
    (EXT, [("d", 30), ("e", 3)], 0, False),
    (EXT, [("a", 9), ("b", 13)], 0, False),                  # prefix hit + fresh prefill
    (EXT, [("c", 7), ("a", 9), ("d", 1), ("e", 1)], 2, False),   # chunks + decode tail
    (DEC, [("a", 1), ("b", 1), ("c", 1)], 0, False),
    (DEC, [("a", 1), ("b", 1), ("c", 1), ("d", 1)], 0, True),
]


def _run(h, r, n, p, v, dtype, tol, scale=1, kv_dtype=None, kv_scale=1.0):
    hid = 32
    layer = make_layer(h, r, n, p, v, hid, dtype)
    layer.kv_scale = kv_scale
    be = create_attention_backend("triton", h, 1, n + p, device_type=DEVICE, device=DEVICE,
                                  num_sms=4, layer_specs=[layer.spec], kv_dtype=kv_dtype)
    assert type(be).__name__ == "TritonMLABackend"
    assert be.kv_fp8 == (kv_dtype is not None)   # the decode's launch table key
    ref_st, tri_st = Stepper(layer, dtype, kv_dtype=kv_dtype), Stepper(layer, dtype, be,
                                                                       kv_dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mode, reqs, nd, graph in STEPS:
            reqs = [(rid, k * scale if k > 1 else k) for rid, k in reqs]
            x = torch.randn(sum(k for _, k in reqs), hid, generator=g).to(dtype).to(DEVICE)
            want = layer(*_args(ref_st.step(layer, mode, reqs, nd), x))
            got = layer(*_args(tri_st.step(layer, mode, reqs, nd, graph), x))
            err = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert torch.isfinite(got).all() and err < tol, (mode, reqs, err)


def _args(fb, x):
    return fb.positions, x, fb


def test_mla_layer_triton_matches_torch_path_fp32():
    _run(h=5, r=32, n=16, p=8, v=12, dtype=torch.float32, tol=2e-5)


def test_mla_layer_triton_matches_torch_path_fp16():
    _run(h=18, r=32, n=16, p=16, v=16, dtype=torch.float16, tol=3e-3)


def test_mla_layer_triton_matches_torch_path_fp8_latent_fp32():
    """An e4m3 latent pool: the decode's fp16 dots against the torch path's fp32 over the same
    stored rows."""
    _run(h=5, r=32, n=16, p=8, v=12, dtype=torch.float32, tol=3e-3,
         kv_dtype=torch.float8_e4m3fn)


def test_mla_layer_triton_matches_torch_path_fp8_latent_scaled_fp16():
    _run(h=18, r=32, n=16, p=16, v=16, dtype=torch.float16, tol=3e-3,
         kv_dtype=torch.float8_e4m3fn, kv_scale=0.25)


@gpu_only
def test_mla_layer_v3_head_shape_fp8_latent_bf16():
    """DeepSeek-V3's head shape over an e4m3 latent pool (the decode's FP8 tiles compiled)."""
    _run(h=128, r=512, n=128, p=64, v=128, dtype=torch.bfloat16, tol=3e-2, scale=40,
         kv_dtype=torch.float8_e4m3fn)


@gpu_only
def test_mla_layer_v3_head_shape_bf16():
    """DeepSeek-V3's head shape (128 heads, R 512, rope 64, nope 128, v 128) in bf16,
    prompts of hundreds of tokens."""
    _run(h=128, r=512, n=128, p=64, v=128, dtype=torch.bfloat16, tol=3e-2, scale=40)


@gpu_only
def test_mla_decode_step_replays_in_a_device_graph():
    """A decode step of the layer (the latent store, the absorbed projections, the split
    counts and both kernels) captured in a device graph replays to the eager output."""
    from engine import device as devlib

    dtype = torch.bfloat16
    layer = make_layer(16, 512, 128, 64, 128, 32, dtype)
    be = create_attention_backend("triton", 16, 1, 192, device_type=DEVICE, device=DEVICE,
                                  num_sms=devlib.multiprocessor_count(DEVICE),
                                  layer_specs=[layer.spec])
    st = Stepper(layer, dtype, be)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        fb = st.step(layer, EXT, [("a", 900), ("b", 70)])
        layer(fb.positions, torch.randn(970, 32, generator=g).to(dtype).to(DEVICE), fb)
        fb = st.step(layer, DEC, [("a", 1), ("b", 1)], graph=True)
        x = torch.randn(2, 32, generator=g).to(dtype).to(DEVICE)
        eager = layer(fb.positions, x, fb)
        devlib.synchronize(DEVICE)
        graph = devlib.graph_class(DEVICE)()
        with devlib.graph_context(DEVICE, graph):
            be.init_forward_graph(fb)
            out = layer(fb.positions, x, fb)
        graph.replay()
        devlib.synchronize(DEVICE)
    torch.testing.assert_close(out, eager)
