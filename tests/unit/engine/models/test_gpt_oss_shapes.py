"""gpt-oss's shipped configs (``engine/configs/gpt-oss-{20b,120b}.json``) build on ``meta``
as the start-up check builds them (MXFP4 experts, alternating sliding/full layers with
sinks, YaRN), and ferry's YaRN table equals transformers' ``_compute_yarn_parameters``."""

from __future__ import annotations

import pytest
import torch

from engine.layer_spec import AttentionKind
from engine.layers.moe import FusedMoE
from engine.layers.rope_scaling import yarn_inv_freq
from engine.layers.rotary import RotaryEmbedding
from engine.loader.loader import config_dir, load_config, load_model


@pytest.mark.parametrize("name,layers,experts", [("gpt-oss-20b", 24, 32),
                                                 ("gpt-oss-120b", 36, 128)])
def test_shipped_config_builds_on_meta(name, layers, experts):
    model, _ = load_model(config_dir(name), "dummy", dtype=torch.bfloat16, device="meta",
                          progress=False)
    assert type(model).__name__ == "GptOssForCausalLM" and model.mxfp4
    specs = model.layer_specs()
    assert len(specs) == layers and all(s.sinks for s in specs)
    assert [s.attention for s in specs[:2]] == [AttentionKind.SLIDING, AttentionKind.FULL]
    assert specs[0].sliding_window == 128 and specs[1].sliding_window is None
    assert model.model_config.max_position_embeddings == 131072      # not capped
    rotary = model.model.rotary_emb           # YaRN (rope_scaling), cos/sin scaled
    assert type(rotary) is RotaryEmbedding and model.model_config.rope_parameters["rope_type"] == "yarn"
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == layers and moes[0].num_experts == experts
    assert moes[0].w13_weight.dtype == torch.uint8
    assert tuple(moes[0].w13_weight.shape) == (experts, 2 * 2880, 90, 16)
    weights = layers * experts * 3 * 2880 * 2880
    biases = layers * experts * (2 * 2880 + 2880) * 2
    assert sum(m.expert_bytes() for m in moes) == weights * 4.25 / 8 + biases
    assert "MXFP4 (4.25 bits a weight)" in model.memory_note()


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_matches_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = load_config(config_dir("gpt-oss-20b"))
    config.rope_parameters = {**config.rope_parameters, "truncate": truncate}
    hf_inv, hf_attn = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    inv, attn = yarn_inv_freq(64, config.rope_parameters["rope_theta"],
                              config.rope_parameters, config.max_position_embeddings)
    assert attn == pytest.approx(hf_attn)
    assert torch.equal(inv, hf_inv.float())


def test_120b_fits_one_h200_with_room_for_kv():
    """The memory line of docs/benchmarks.md: gpt-oss-120b's weights with the experts at
    4.25 bits (blocks + e8m0 scales) and the rest in bf16 come to ~65 GB, leaving more than
    40 GB of a 141 GB H200 for the KV cache (the issue's target)."""
    from bench.roofline import weight_bytes

    model, _ = load_model(config_dir("gpt-oss-120b"), "dummy", dtype=torch.bfloat16,
                          device="meta", progress=False)
    experts = sum(m.expert_bytes() for m in model.modules() if isinstance(m, FusedMoE))
    total = weight_bytes(model)
    assert 60.9e9 < experts < 61.1e9 and 65.1e9 < total < 65.4e9
    assert 141e9 - total > 40e9
