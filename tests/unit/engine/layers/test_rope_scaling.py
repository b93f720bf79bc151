"""ferry's rope types and layouts vs transformers' (``ROPE_INIT_FUNCTIONS``, the families'
rotary modules and ``apply_rotary_pos_emb``): inverse frequencies, attention factors, the
cos/sin table, and the rotation of q and k (partial, interleaved)."""

from __future__ import annotations

import pytest
import torch

from engine.layers import rope_scaling
from engine.layers.rotary import RotaryEmbedding, compute_inv_freq, rope_config

T = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

SHAPE = {"hidden_size": 128, "num_attention_heads": 2, "max_position_embeddings": 512}
LLAMA_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 3.0, "truncate": False,
                         "original_max_position_embeddings": 100},
}


def _llama(params: dict):
    return T.LlamaConfig(**SHAPE, rope_parameters={**params, "rope_theta": 50000.0})


def _phi3(max_pos: int = 512, partial: float = 0.5):
    rd = int(64 * partial)
    g = torch.Generator().manual_seed(1)
    short = (1 + torch.rand(rd // 2, generator=g)).tolist()
    long = (1 + 4 * torch.rand(rd // 2, generator=g)).tolist()
    return T.Phi3Config(**{**SHAPE, "max_position_embeddings": max_pos},
                        partial_rotary_factor=partial,
                        rope_parameters={"rope_type": "longrope", "short_factor": short,
                                         "long_factor": long, "rope_theta": 10000.0,
                                         "original_max_position_embeddings": 128})


def _ours(config) -> RotaryEmbedding:
    theta, params = rope_config(config)
    return RotaryEmbedding(64, config.max_position_embeddings, theta, params)


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_inv_freq_and_attention_factor_match_transformers(case):
    cfg = _llama(LLAMA_CASES[case])
    theta, params = rope_config(cfg)
    inv_ref, factor_ref = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(compute_inv_freq(64, theta, params), inv_ref.float(),
                               rtol=1e-6, atol=0)
    table = _ours(cfg).cos_sin_cache
    assert table[0, 0].item() == pytest.approx(factor_ref, rel=1e-6)   # cos(0) * factor


def test_dynamic_ntk_grows_the_base_as_transformers_does():
    cfg = _llama(LLAMA_CASES["dynamic"])
    theta, params = rope_config(cfg)
    for seq_len in (100, 512, 700, 2048):
        ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=seq_len)
        ours = rope_scaling.dynamic_ntk_inv_freq(64, theta, params, 512, seq_len)
        torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", ["default", "yarn", "yarn_mscale", "llama3"])
def test_cos_sin_table_matches_the_llama_rotary_module(case):
    cfg = _llama(LLAMA_CASES.get(case, {"rope_type": "default"}))
    ref_mod = T.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 5, 127, 128, 300, 511]])
    cos, sin = ref_mod(torch.zeros(1, dtype=torch.float32), pos)
    ours_cos, ours_sin = _ours(cfg)(pos[0])
    torch.testing.assert_close(ours_cos, cos[0, :, :32], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_sin, sin[0, :, :32], rtol=1e-5, atol=1e-5)


def test_longrope_short_then_long_and_partial_rotation_match_phi3():
    """Sequences within original_max_position_embeddings (128): transformers' short factors,
    in ferry's table rows below 128; a longer one: its long factors, ferry's rows from 128
    on (the module docstring of ``engine.layers.rope_scaling``). The attention factor
    sqrt(1 + ln 4 / ln 128) scales both."""
    from transformers.models.phi3 import modeling_phi3 as M

    cfg = _phi3()
    ours = _ours(cfg)
    assert ours.rotary_dim == 32
    ref_mod = M.Phi3RotaryEmbedding(cfg)
    x = torch.zeros(1)
    short_pos = torch.arange(100)[None]
    cos, sin = ref_mod(x, short_pos)
    torch.testing.assert_close(ours(short_pos[0])[0], cos[0, :, :16], rtol=1e-5, atol=1e-5)
    long_pos = torch.arange(400)[None]
    cos, sin = ref_mod(x, long_pos)
    tail = long_pos[0, 128:]
    torch.testing.assert_close(ours(tail)[1], sin[0, 128:, :16], rtol=1e-5, atol=1e-5)
    inv_long, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=400)
    assert factor == pytest.approx(
        rope_scaling.longrope_attention_factor(rope_config(cfg)[1], 512))
    # the rotation of q/k (partial: dims 32.. pass through), short range
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 4 * 64, generator=g), torch.randn(7, 2 * 64, generator=g)
    pos = torch.tensor([0, 3, 9, 50, 99, 120, 127])
    cos, sin = M.Phi3RotaryEmbedding(cfg)(x, pos[None])
    q_ref, k_ref = M.apply_rotary_pos_emb(q.view(1, 7, 4, 64).transpose(1, 2),
                                          k.view(1, 7, 2, 64).transpose(1, 2), cos, sin)
    q_ours, k_ours = ours.rotate(q, k, pos)
    torch.testing.assert_close(q_ours, q_ref.transpose(1, 2).reshape(7, -1), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(k_ours, k_ref.transpose(1, 2).reshape(7, -1), rtol=1e-5,
                               atol=1e-5)


def test_interleaved_partial_rotation_matches_glm4():
    from transformers.models.glm4 import modeling_glm4 as M

    cfg = T.Glm4Config(hidden_size=128, num_attention_heads=2, head_dim=64,
                       max_position_embeddings=256)
    theta, params = rope_config(cfg)
    assert params["partial_rotary_factor"] == 0.5
    ours = RotaryEmbedding(64, 256, theta, params, interleaved=True)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 2 * 64, generator=g), torch.randn(5, 64, generator=g)
    pos = torch.tensor([0, 1, 17, 100, 255])
    cos, sin = M.Glm4RotaryEmbedding(cfg)(torch.zeros(1), pos[None])
    q_ref, k_ref = M.apply_rotary_pos_emb(q.view(1, 5, 2, 64).transpose(1, 2),
                                          k.view(1, 5, 1, 64).transpose(1, 2), cos, sin)
    q_ours, k_ours = ours.rotate(q, k, pos)
    torch.testing.assert_close(q_ours, q_ref.transpose(1, 2).reshape(5, -1), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(k_ours, k_ref.transpose(1, 2).reshape(5, -1), rtol=1e-5,
                               atol=1e-5)


def test_bad_longrope_factor_length_is_refused():
    cfg = _phi3()
    theta, params = rope_config(cfg)
    with pytest.raises(ValueError, match="short_factor has 16 entries"):
        RotaryEmbedding(64, 512, theta, {**params, "partial_rotary_factor": 1.0})
