"""engine/configs/qwen3-next-80b-a3b.json: transformers reads it as Qwen3-Next-80B-A3B (48
layers, every fourth full attention, 512 experts of which 10 routed) and builds it on `meta`
at its published size (about 80B parameters)."""

from __future__ import annotations

import os

import pytest
import torch

import engine

PATH = os.path.join(os.path.dirname(engine.__file__), "configs", "qwen3-next-80b-a3b.json")


def test_real_shape_config_builds_in_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM

    pytest.importorskip("transformers.models.qwen3_next")
    cfg = AutoConfig.from_pretrained(PATH)
    assert cfg.model_type == "qwen3_next"
    assert cfg.layer_types.count("full_attention") == 12
    assert cfg.layer_types[3] == "full_attention" and cfg.layer_types[0] == "linear_attention"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert 79e9 < total < 82e9


@pytest.mark.parametrize("name,arch,layers,full,params", [
    ("qwen3-next-80b-a3b", "Qwen3NextForCausalLM", 48, 12, (79e9, 82e9)),
    ("qwen3-next-80b-a3b-24layers", "Qwen3NextForCausalLM", 24, 6, (39e9, 41e9)),
    ("qwen3.5-35b-a3b", "Qwen3_5MoeForCausalLM", 40, 10, (34e9, 36e9)),
])
def test_real_shapes_build_on_meta_in_ferry(name, arch, layers, full, params):
    """The preflight's meta build of ferry's class: the hybrid layer specs (LINEAR layers
    keeping a [32, 128, 128] recurrent state and a 3-input conv state of q|k|v), the
    parameter count, the dummy-weight shapes of every checkpoint tensor, and that device
    graphs pass the preflight on a GPU (decode graphs run; prefill stays eager)."""
    from engine.args import ServerArgs
    from engine.executor.preflight import build_meta_model, check_recurrent_state_flags
    from engine.kv.state_pool import RecurrentStatePool
    from engine.layer_spec import CacheKind

    path = os.path.join(os.path.dirname(engine.__file__), "configs", f"{name}.json")
    args = ServerArgs(model_path=path, load_format="dummy")
    model = build_meta_model(args, "cpu")
    assert type(model).__name__ == arch
    specs = model.layer_specs()
    assert len(specs) == layers
    assert sum(s.cache == CacheKind.PAGED_KV for s in specs) == full
    linear = [s.state for s in specs if s.cache == CacheKind.RECURRENT_STATE]
    assert {(s.num_v_heads, s.k_head_dim, s.v_head_dim, s.conv_dim) for s in linear} == {
        (32, 128, 128, 2 * 16 * 128 + 32 * 128)}
    per_slot = RecurrentStatePool.bytes_per_slot(linear, torch.bfloat16)
    assert per_slot == len(linear) * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    total = sum(p.numel() for p in model.parameters())
    assert params[0] < total < params[1]
    shapes = model.hf_weight_shapes()
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 16 * 256, 2048)
    assert len(shapes) == len(model.expected_weights())
    check_recurrent_state_flags(model, args, "cuda")   # decode graphs run
    check_recurrent_state_flags(model, args.replace(disable_cuda_graph=True), "cuda")
