"""The shipped configs of issue 42's families (Phi-4 14B, Mistral-7B-v0.1, GLM-4-9B-0414)
build on the ``meta`` device through the start-up check (``--load-format dummy``), with
their real shapes, windows and rotary."""

from __future__ import annotations

import pytest

from engine.args import ServerArgs
from engine.executor.preflight import build_meta_model
from engine.loader.loader import config_dir


def _meta(name: str):
    model = build_meta_model(ServerArgs(model_path=config_dir(name), load_format="dummy",
                                        device="cpu", dtype="bfloat16"), "cpu")
    assert model is not None
    return model


def test_phi4_14b():
    m = _meta("phi-4")
    assert type(m).__name__ == "Phi3ForCausalLM"
    mc = m.model_config
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim) == \
        (40, 5120, 40, 10, 128)
    assert mc.context_length == 16384
    assert all(s.sliding_window is None for s in m.layer_specs())
    assert 14.0e9 < sum(p.numel() for p in m.parameters()) < 15.0e9


def test_mistral_7b_keeps_its_context_and_windows_every_layer():
    m = _meta("mistral-7b-v0.1")
    assert m.model_config.context_length == 32768          # no longer capped at 4096
    assert {s.sliding_window for s in m.layer_specs()} == {4096}
    assert {s.attention.value for s in m.layer_specs()} == {"sliding"}


def test_glm4_9b_0414():
    m = _meta("glm-4-9b-0414")
    layer = m.model.layers[0]
    assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.o_proj.bias is None
    assert layer.post_self_attn_layernorm.weight.shape == (4096,)
    rope = m.model.rotary_emb
    assert (rope.rotary_dim, rope.interleaved) == (64, True)
    assert m.layer_specs()[0].rotary.partial_factor == 0.5
    assert 9.0e9 < sum(p.numel() for p in m.parameters()) < 9.8e9


@pytest.mark.parametrize("name", ["phi-4", "glm-4-9b-0414"])
def test_lora_is_refused_at_start_up(name, monkeypatch):
    from engine.executor import preflight

    model = _meta(name)
    with pytest.raises(ValueError, match=f"{type(model).__name__}: LoRA adapters on its fused"):
        preflight.check_lora_model(model)


def _hf_config(case: str):
    """Phi-3.5-mini-shaped rope (longrope, partial) and GLM-4's, on tiny shapes."""
    import transformers as T

    common = {"vocab_size": 128, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96,
              "max_position_embeddings": 1024, "pad_token_id": 0, "bos_token_id": 1,
              "eos_token_id": 2}
    if case == "phi3":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0,
                "original_max_position_embeddings": 256,
                "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
        return T.Phi3Config(**common, partial_rotary_factor=0.75, rope_parameters=rope)
    return T.Glm4Config(**common, head_dim=16)


@pytest.mark.parametrize("case", ["phi3", "glm4"])
def test_meta_build_and_checkpoint_names_are_the_fused_ones(case):
    """Built on ``meta`` (the start-up check: the rope tables stay on the CPU), the model's
    checkpoint names and shapes are HF's (fused ``qkv_proj``/``gate_up_proj``), which
    llama.cpp's name table maps to ``attn_qkv``/``ffn_up`` for GGUF files."""
    import torch
    from gguf import MODEL_ARCH, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    from engine.models import get_model_class

    cfg = _hf_config(case)
    with torch.device("meta"):
        ours = get_model_class(cfg)(cfg)
        hf = AutoModelForCausalLM.from_config(cfg)
    assert ours.hf_weight_shapes() == {n: tuple(p.shape) for n, p in hf.named_parameters()}
    table = get_tensor_name_map(MODEL_ARCH.PHI3 if case == "phi3" else MODEL_ARCH.GLM4, 2)
    assert table.get_name("model.layers.1.mlp.gate_up_proj") == "blk.1.ffn_up"
    if case == "phi3":
        assert table.get_name("model.layers.1.self_attn.qkv_proj") == "blk.1.attn_qkv"
