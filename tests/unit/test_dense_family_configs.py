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
