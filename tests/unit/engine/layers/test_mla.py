"""MLA (engine/layers/mla.py) over the latent pool against dense attention: the queries, the
decompressed keys and values of every earlier token, HF's interleaved rotary; through
prefill, an extend with a cached prefix, a batch of two and decodes."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb_interleave,
)

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kv.pool import ReqToTokenPool, build_kv_pool
from engine.layers.mla import MLAttention, mla_softmax_scale
from engine.layers.rotary import RotaryEmbedding

H, R, N, P, V, HID = 3, 16, 8, 4, 6, 24


def make_layer(q_lora_rank, seed=0):
    torch.manual_seed(seed)
    rot = RotaryEmbedding(P, 64, 10000.0)
    layer = MLAttention(HID, H, q_lora_rank, R, N, P, V, 0, rot, 1e-6, torch.float32,
                        mla_softmax_scale(N + P, None))
    for p in layer.parameters():
        p.data.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 1.0) + (p.ndim == 1))
    return layer


def dense(layer: MLAttention, x: torch.Tensor) -> torch.Tensor:
    """x [S, HID] of one sequence from position 0 -> [S, HID], decompressed K/V."""
    s = x.shape[0]
    q = layer._queries(x).transpose(0, 1)[None]                  # [1, H, S, N+P]
    q_nope, q_pe = q.split([N, P], dim=-1)
    c, k_pe = layer.kv_a_proj_with_mqa(x).split([R, P], dim=-1)
    c = layer.kv_a_layernorm(c.contiguous())
    inv = 1.0 / 10000.0 ** (torch.arange(0, P, 2).float() / P)
    f = torch.outer(torch.arange(s).float(), inv)
    emb = torch.cat([f, f], dim=-1)[None]
    q_pe, k_pe = apply_rotary_pos_emb_interleave(q_pe, k_pe[None, None], emb.cos(), emb.sin())
    kv = layer.kv_b_proj(c).view(s, H, N + V).transpose(0, 1)   # [H, S, N+V]
    k = torch.cat([kv[..., :N], k_pe[0].expand(H, s, P)], dim=-1)
    scores = torch.einsum("hqd,hkd->hqk", torch.cat([q_nope, q_pe], -1)[0], k) * layer.scaling
    scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,hkv->qhv", scores.softmax(-1), kv[..., N:]).reshape(s, H * V)
    return layer.o_proj(o)


class Latent:
    def __init__(self, layer):
        self.pool = build_kv_pool([layer.spec], 256, 4, torch.float32, "cpu")
        self.r2t = ReqToTokenPool(4, 64, "cpu")
        self.rows, self.pages, self.lens = {}, {}, {}

    def step(self, layer, mode, reqs):
        rows, pos, locs, seq, ext, xs = [], [], [], [], [], []
        for rid, x in reqs:
            if rid not in self.rows:
                self.rows[rid], self.pages[rid], self.lens[rid] = self.r2t.alloc(), [], 0
            cur, n = self.lens[rid], x.shape[0]
            slots = self.pool.grow(self.pages[rid], cur, n)
            self.r2t.req_to_token[self.rows[rid], cur:cur + n] = torch.tensor(slots)
            rows.append(self.rows[rid])
            pos += range(cur, cur + n)
            locs += slots
            seq.append(cur + n)
            ext.append(n)
            xs.append(x)
            self.lens[rid] = cur + n
        fb = ForwardBatch(mode=mode, batch_size=len(reqs), positions=torch.tensor(pos),
                          req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq),
                          out_cache_loc=torch.tensor(locs),
                          req_to_token=self.r2t.req_to_token, k_buffers=self.pool.k_buffers,
                          v_buffers=self.pool.v_buffers, seq_lens_cpu=seq,
                          extend_seq_lens_cpu=[] if mode == ForwardMode.DECODE else ext,
                          extend_seq_lens=torch.tensor(ext))
        return layer(fb.positions, torch.cat(xs), fb)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_matches_dense_attention(q_lora_rank):
    layer = make_layer(q_lora_rank)
    torch.manual_seed(1)
    a, b = torch.randn(10, HID), torch.randn(6, HID)
    ref_a, ref_b = dense(layer, a), dense(layer, b)
    st = Latent(layer)
    with torch.no_grad():
        out = st.step(layer, ForwardMode.EXTEND, [("a", a[:5])])          # prefill
        torch.testing.assert_close(out, ref_a[:5], atol=1e-5, rtol=1e-5)
        out = st.step(layer, ForwardMode.EXTEND, [("a", a[5:8]), ("b", b[:4])])  # prefix + new
        torch.testing.assert_close(out, torch.cat([ref_a[5:8], ref_b[:4]]), atol=1e-5, rtol=1e-5)
        for i in range(2):                                                # decodes
            out = st.step(layer, ForwardMode.DECODE, [("a", a[8 + i:9 + i]), ("b", b[4 + i:5 + i])])
            torch.testing.assert_close(out, torch.stack([ref_a[8 + i], ref_b[4 + i]]),
                                       atol=1e-5, rtol=1e-5)
    # the pool holds the normed latent and the rotated rope key: one head of R + P values
    assert st.pool.k_buffers[0].shape[1:] == (1, R + P)


def test_mscale_on_the_softmax_scale():
    assert mla_softmax_scale(192, None) == 192 ** -0.5
    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 0.707}
    m = 0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1
    assert mla_softmax_scale(192, yarn) == pytest.approx(192 ** -0.5 * m * m)


def test_yarn_table_matches_hf():
    """DeepSeek-V2-Lite's YaRN (factor 40, mscale = mscale_all_dim): HF's frequencies and
    cos/sin magnitude."""
    from transformers import DeepseekV2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 64,
            "rope_theta": 10000.0}
    for extra in ({}, {"mscale": 1.0}):
        params = {**yarn, **extra}
        cfg = DeepseekV2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                               qk_rope_head_dim=P, max_position_embeddings=2560,
                               rope_parameters=params)
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        rot = RotaryEmbedding(P, 128, 10000.0, params)
        t = torch.arange(128).float()[:, None] * inv[None]
        ref = torch.cat([t.cos(), t.sin()], dim=-1) * factor
        torch.testing.assert_close(rot.cos_sin_cache, ref)


def test_fp8_latent_store_saturates_and_reads_back_scaled():
    """An e4m3 cache: values past +-448 saturate (not NaN), a per-tensor scale divides on the
    way in and multiplies on the way out; a bf16 cache is a plain cast."""
    from engine.layers.mla import latent_rows, store_latent

    lat = torch.tensor([[500.0, -1000.0, 1.0, 3.0], [0.5, -2.0, 448.0, 0.0]])
    loc, e4m3 = torch.tensor([3, 1]), torch.float8_e4m3fn
    buf = torch.zeros(5, 1, 4, dtype=e4m3)
    store_latent(buf, loc, lat)
    assert buf[3, 0].float().tolist() == [448.0, -448.0, 1.0, 3.0]
    assert latent_rows(buf, loc, torch.float32).tolist() == [[448.0, -448.0, 1.0, 3.0],
                                                             [0.5, -2.0, 448.0, 0.0]]
    store_latent(buf, loc, lat, kv_scale=4.0)
    assert buf[1, 0].float().tolist() == [0.125, -0.5, 112.0, 0.0]
    # 500 / 4 = 125 rounds to e4m3's 128 (steps of 8 between 64 and 128)
    assert latent_rows(buf, loc, torch.float32, kv_scale=4.0)[0].tolist() == \
        [512.0, -1024.0, 1.0, 3.0]
    wide = torch.zeros(5, 1, 4, dtype=torch.bfloat16)
    store_latent(wide, loc, lat, kv_scale=4.0)        # the scale is an FP8 cache's only
    assert wide[3, 0].float().tolist() == [500.0, -1000.0, 1.0, 3.0]
