"""Gemma's layer variants (engine/layers/) against HF's modules, and the Gemma families'
real-shape configs built on ``meta``: the layer specs (windows, scales, soft-caps, rope per
layer type), the context (no window cap), FP8 on the linear layers, GGUF's model types."""

from __future__ import annotations

import os

import pytest
import torch

import engine
from engine.layer_spec import AttentionKind
from engine.layers.activation import GeluTanhAndMul, gated_activation
from engine.layers.linear import embedding_scale
from engine.layers.logits import softcap
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import compute_inv_freq, linear_scaled_inv_freq

CONFIGS = os.path.join(os.path.dirname(engine.__file__), "configs")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_hf(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 32, generator=g).to(dtype) for _ in range(2))
    hf = Gemma3RMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(32, generator=g))
    ours = GemmaRMSNorm(32, 1e-6, dtype)
    ours.weight.data.copy_(hf.weight)
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)
    out, res = ours(x, r)
    torch.testing.assert_close(res, x + r, rtol=0, atol=0)
    torch.testing.assert_close(out, hf(x + r), rtol=0, atol=0)


def test_gelu_tanh_and_mul_and_softcap():
    x = torch.randn(3, 8)
    gate, up = x.chunk(2, -1)
    torch.testing.assert_close(GeluTanhAndMul()(x),
                               torch.nn.functional.gelu(gate, approximate="tanh") * up)
    assert isinstance(gated_activation("gelu_pytorch_tanh"), GeluTanhAndMul)
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu'"):
        gated_activation("relu")
    y = softcap(torch.tensor([-1e4, 0.0, 1.0, 1e4]), 30.0)
    assert y.abs().max() <= 30.0 and y[1] == 0
    torch.testing.assert_close(y[2], torch.tensor(30 * torch.tanh(torch.tensor(1 / 30)).item()))


def test_embedding_scale_rounds_to_the_dtype_like_hf():
    assert embedding_scale(3072, torch.bfloat16) == 55.5            # sqrt(3072) = 55.43
    assert embedding_scale(3072, torch.float32) == pytest.approx(3072 ** 0.5, rel=1e-7)
    e = torch.randn(4, 3072).to(torch.bfloat16)
    hf = e * torch.tensor(3072 ** 0.5, dtype=torch.bfloat16)       # Gemma2Model's normalizer
    assert torch.equal(e * embedding_scale(3072, torch.bfloat16), hf)


def test_linear_rope_scaling_divides_the_frequencies():
    base = compute_inv_freq(16, 1e6, {"rope_type": "default"})
    params = {"rope_type": "linear", "factor": 8.0}
    torch.testing.assert_close(linear_scaled_inv_freq(base, params), base / 8)
    torch.testing.assert_close(compute_inv_freq(16, 1e6, params), base / 8)


def _meta(name: str, **kw):
    from engine.loader.loader import load_model

    model, _ = load_model(os.path.join(CONFIGS, f"{name}.json"), "dummy", dtype=torch.bfloat16,
                          device="meta", progress=False, **kw)
    return model


def test_gemma_3_27b_config_layers():
    m = _meta("gemma-3-27b")
    assert type(m).__name__ == "Gemma3ForConditionalGeneration"
    specs = m.layer_specs()
    assert len(specs) == 62 and m.model_config.context_length == 131072   # no window cap
    glob = [i for i, s in enumerate(specs) if s.attention == AttentionKind.FULL]
    assert glob == list(range(5, 62, 6))                                  # 5 local : 1 global
    local = specs[0]
    assert local.sliding_window == 1024 and local.rotary.base == 10000.0
    assert specs[5].rotary.kind == "linear" and specs[5].rotary.base == 1e6
    assert {s.scale for s in specs} == {168 ** -0.5}
    assert all(s.logit_softcap is None for s in specs)
    assert m.model.embed_scale == 73.5                                    # bf16(sqrt(5376))
    assert len(m.model.rotary_embs) == 2
    encoder = ("vision_tower.", "multi_modal_projector.")
    sizes = {n: p.numel() for n, p in m.named_parameters()}
    lm = sum(v for n, v in sizes.items() if not n.startswith(encoder))
    assert lm == pytest.approx(27.0e9, rel=0.01)
    # SigLIP so400m without its pooling head (27 layers, 1152 wide, 64x64 patches of 14:
    # 416,866,032 in transformers' SiglipVisionModel) and the 1152 -> 5376 projector with
    # its norm: 27.4B in all, the published figure
    assert sum(sizes.values()) - lm == 416_866_032 + 1152 * 5376 + 1152
    assert m.vision_tower.embeddings.position_embedding.weight.shape == (4096, 1152)
    assert len(m.vision_tower.encoder.layers) == 27
    assert m.multi_modal_projector.kernel == 4              # 64 patches a side -> 16 tokens


def test_gemma_2_9b_config_layers_and_fp8():
    m = _meta("gemma-2-9b", quantization="fp8")
    specs = m.layer_specs()
    assert [s.sliding_window for s in specs[:4]] == [4096, None, 4096, None]
    assert {s.logit_softcap for s in specs} == {50.0} and m.final_logit_softcap == 30.0
    assert {s.scale for s in specs} == {256 ** -0.5}
    assert m.model_config.context_length == 8192
    layer = m.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.pre_feedforward_layernorm.weight.dtype == torch.bfloat16


def test_gguf_model_types_map_to_the_gemma_classes():
    from transformers import Gemma2Config, Gemma3TextConfig

    from engine.models import get_model_class

    for cfg, name in ((Gemma2Config(), "Gemma2ForCausalLM"),
                      (Gemma3TextConfig(), "Gemma3ForCausalLM")):
        cfg.architectures = None                       # as read from a GGUF file
        assert get_model_class(cfg).__name__ == name


def test_gemma4_proportional_rope_and_unit_norm_match_hf():
    """Gemma 4's global layers: ``proportional`` rope (a quarter of the frequency pairs
    turn, over the whole head) as transformers computes and applies it; the weightless v
    norm as HF's ``Gemma4RMSNorm(with_scale=False)``."""
    import transformers as T
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, apply_rotary_pos_emb

    from engine.layers.norm import UnitRMSNorm
    from engine.layers.rotary import RotaryEmbedding

    params = {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    cfg = T.Gemma4TextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=16, global_head_dim=32, num_hidden_layers=2,
                             layer_types=["sliding_attention", "full_attention"],
                             rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                    "rope_theta": 100.0},
                                              "full_attention": params})
    inv, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu", layer_type="full_attention")
    ours = compute_inv_freq(32, 10000.0, params)
    assert int((ours != 0).sum()) == 4
    torch.testing.assert_close(ours, inv, rtol=1e-6, atol=0)
    rope = RotaryEmbedding(32, 64, 10000.0, params)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 2 * 32, generator=g), torch.randn(5, 32, generator=g)
    pos = torch.tensor([0, 3, 7, 20, 63])
    freqs = pos[:, None].float() * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    ref_q = apply_rotary_pos_emb(q.view(5, 2, 32), emb.cos(), emb.sin(), unsqueeze_dim=1)
    rq, rk = rope.rotate(q, k, pos)
    torch.testing.assert_close(rq, ref_q.reshape(5, 64), rtol=1e-5, atol=1e-5)
    x = torch.randn(3, 4, 32, generator=g)
    torch.testing.assert_close(UnitRMSNorm(1e-6)(x), Gemma4RMSNorm(32, 1e-6, with_scale=False)(x),
                               rtol=1e-6, atol=1e-6)

