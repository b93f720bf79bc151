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
