"""``ModelConfig.from_hf`` against hand-written numbers, and the model contract."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlavaConfig, Qwen3Config

from engine.models import MODEL_REGISTRY, CausalLM, ModelConfig


def test_llama_3_8b():
    c = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=4096,
                    intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192})
    m = ModelConfig.from_hf(c)
    assert m.architecture == "LlamaForCausalLM" and m.model_type == "llama"
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == \
        (32, 4096, 32, 8, 128)
    assert (m.intermediate_size, m.vocab_size, m.context_length) == (14336, 128256, 131072)
    assert m.q_size == 4096 and m.kv_size == 1024
    assert m.rms_norm_eps == 1e-5 and m.tie_word_embeddings is False
    assert m.rope_theta == 500000.0
    assert m.rope_parameters["rope_type"] == "llama3" and m.rope_parameters["factor"] == 8.0
    assert m.hidden_act == "silu" and not m.attention_bias and not m.mlp_bias
    assert ModelConfig.from_hf(m) is m
    with pytest.raises(AttributeError):
        m.vocab_size = 1  # frozen


def test_qwen3_explicit_head_dim():
    # Qwen3-0.6B: head_dim 128 although hidden_size / heads = 64
    c = Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_size=1024, head_dim=128,
                    intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                    num_hidden_layers=28, vocab_size=151936, max_position_embeddings=40960,
                    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
    m = ModelConfig.from_hf(c)
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (16, 8, 128)
    assert m.q_size == 2048 and m.kv_size == 1024
    assert m.tie_word_embeddings is True and m.rope_theta == 1000000.0
    assert m.rope_parameters["rope_type"] == "default"
    assert (m.num_layers, m.vocab_size, m.context_length) == (28, 151936, 40960)


def test_multimodal_text_config():
    c = LlavaConfig(architectures=["LlavaForConditionalGeneration"], tie_word_embeddings=False,
                    text_config={"model_type": "llama", "hidden_size": 256,
                                 "num_attention_heads": 8, "num_key_value_heads": 2,
                                 "num_hidden_layers": 3, "intermediate_size": 512,
                                 "vocab_size": 1000, "max_position_embeddings": 1024,
                                 "rms_norm_eps": 1e-5})
    m = ModelConfig.from_hf(c)
    assert m.architecture == "LlavaForConditionalGeneration" and m.model_type == "llama"
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == \
        (3, 256, 8, 2, 32)
    assert (m.intermediate_size, m.vocab_size, m.context_length) == (512, 1000, 1024)
    assert m.tie_word_embeddings is False


def test_defaults_of_a_sparse_config():
    # a GGUF-derived config: no architectures, no KV heads, no head_dim, no context
    c = SimpleNamespace(model_type="qwen2", hidden_size=896, num_attention_heads=14,
                        num_hidden_layers=24, intermediate_size=4864, vocab_size=151936)
    m = ModelConfig.from_hf(c)
    assert m.architecture == "Qwen2ForCausalLM"
    assert (m.num_kv_heads, m.head_dim, m.context_length) == (14, 64, 4096)
    assert m.rms_norm_eps == 1e-6 and m.tie_word_embeddings is False
    assert m.rope_theta == 10000.0


def test_shipped_config_with_sliding_window_cap():
    from engine.loader.loader import config_dir, load_config

    m = ModelConfig.from_hf(load_config(config_dir("qwen2.5-7b")))
    assert (m.architecture, m.num_layers, m.hidden_size) == ("Qwen2ForCausalLM", 28, 3584)
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (28, 4, 128)
    assert (m.intermediate_size, m.vocab_size, m.context_length) == (18944, 152064, 32768)


# ---- the contract -----------------------------------------------------------------------

def _tiny(arch: str):
    kw = dict(architectures=[arch], hidden_size=64, intermediate_size=96,
              num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
              vocab_size=128, max_position_embeddings=256)
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    if arch == "Qwen3MoeForCausalLM":   # layer 2 dense
        return transformers.Qwen3MoeConfig(head_dim=32, mlp_only_layers=[2], **moe, **kw)
    if arch == "Qwen2MoeForCausalLM":   # layer 2 dense, a shared expert
        return transformers.Qwen2MoeConfig(mlp_only_layers=[2], **moe, **kw,
                                           shared_expert_intermediate_size=48)
    if arch == "MixtralForCausalLM":
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kw)
    if arch == "OlmoeForCausalLM":
        return transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **kw)
    if arch == "GptOssForCausalLM":     # sliding layers 0 and 2, stacked experts
        return transformers.GptOssConfig(num_local_experts=4, num_experts_per_tok=2,
                                         head_dim=16, sliding_window=8, **kw)
    if arch.startswith("Deepseek"):     # MLA (head_dim: the rope part), layer 0 dense
        cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
        return cls(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                   qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_group=1,
                   topk_group=1, **kw)
    if arch == "Glm4MoeForCausalLM":    # layer 0 dense, q/k norms, half the head rotated
        return transformers.Glm4MoeConfig(n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, first_k_dense_replace=1,
                                          n_group=2, topk_group=1, use_qk_norm=True,
                                          attention_bias=True, **kw)
    if arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        text = _tiny(arch.replace("ForConditionalGeneration", "ForCausalLM")).to_dict()
        cls = (transformers.Qwen3_5Config if arch.startswith("Qwen3_5For")
               else transformers.Qwen3_5MoeConfig)
        return cls(architectures=[arch], text_config=text,
                   vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                  "num_heads": 2, "out_hidden_size": 64})
    if arch in ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):
        # hybrid: the contract's checks count attention layers, so all three are full here
        # (the linear layers: tests/engine/test_qwen3_next.py)
        cls = {"Qwen3NextForCausalLM": transformers.Qwen3NextConfig,
               "Qwen3_5ForCausalLM": transformers.Qwen3_5TextConfig,
               "Qwen3_5MoeForCausalLM": transformers.Qwen3_5MoeTextConfig}[arch]
        extra = {} if arch == "Qwen3_5ForCausalLM" else {
            **moe, "shared_expert_intermediate_size": 48}
        return cls(head_dim=32, layer_types=["full_attention"] * 3, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   **extra, **kw)
    if arch == "Qwen3VLForConditionalGeneration":  # interleaved M-RoPE over head 32
        text = {k: v for k, v in kw.items() if k != "architectures"}
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
        return transformers.Qwen3VLConfig(
            architectures=[arch], text_config=dict(text, head_dim=32, rope_parameters=rope),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                               out_hidden_size=64, num_position_embeddings=16,
                               deepstack_visual_indexes=[0]), image_token_id=120)
    if arch.startswith("Qwen3"):
        return Qwen3Config(head_dim=32, **kw)
    if arch == "Qwen2_5_VLForConditionalGeneration":  # M-RoPE over head 16, a 2-block tower
        text = {k: v for k, v in kw.items() if k != "architectures"}
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        return transformers.Qwen2_5_VLConfig(
            architectures=[arch], text_config=dict(text, rope_parameters=rope),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                               out_hidden_size=64), image_token_id=120)
    if arch == "Gemma3ForConditionalGeneration":  # a 1-layer SigLIP, 4 tokens per image
        text = {k: v for k, v in kw.items() if k != "architectures"}
        return transformers.Gemma3Config(
            architectures=[arch], text_config=dict(text, head_dim=16, sliding_window=8),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, image_size=28, patch_size=7),
            mm_tokens_per_image=4, image_token_index=120, boi_token_index=118,
            eoi_token_index=119)
    if arch.startswith("Gemma4"):       # layer 2 global (head size 32), per-layer inputs
        text = transformers.Gemma4TextConfig(head_dim=16, global_head_dim=32, sliding_window=8,
                                             hidden_size_per_layer_input=8, **kw)
        if arch == "Gemma4ForCausalLM":
            return text
        return transformers.Gemma4Config(text_config=text.to_dict(), architectures=[arch])
    return LlamaConfig(**kw)


@pytest.mark.parametrize("arch", sorted(MODEL_REGISTRY))
def test_every_registered_model_keeps_the_contract(arch):
    cls = MODEL_REGISTRY[arch]
    assert issubclass(cls, CausalLM) and not inspect.isabstract(cls)
    with torch.device("meta"):
        model = cls(_tiny(arch), torch.float32)
    head_dim = 32 if arch.startswith("Qwen3") else 16
    assert isinstance(model.model_config, ModelConfig)
    assert model.model_config.architecture == arch
    layers = model.attention_layers()
    assert len(layers) == 3 and model.num_pieces == 4
    assert [a.layer_id for a in layers] == [0, 1, 2]
    assert (model.q_size, model.kv_size) == (4 * head_dim, 2 * head_dim)
    assert tuple(model.lm_head_weight.shape) == (128, 64)
    names = model.hf_weight_names()
    # q/k/v apart, or fused as the checkpoint stores them (Phi-3)
    assert {"model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.qkv_proj.weight"} & set(names)
    # layer 2's MLP: dense (gate/up apart or fused: Phi-3, GLM-4), or the experts of an
    # all-MoE model (gpt-oss: stacked experts)
    assert {"model.layers.2.mlp.gate_proj.weight", "model.layers.2.mlp.gate_up_proj.weight",
            "model.layers.2.mlp.experts.3.gate_proj.weight",
            "model.layers.2.block_sparse_moe.experts.3.w1.weight",
            "model.layers.2.mlp.experts.gate_up_proj"} & set(names)
    # a fused checkpoint tensor (Phi-3's qkv_proj, Phi-3's and GLM-4's gate_up_proj) is
    # expected once per part it loads: 3 and 2 parts (gpt-oss's stacked experts: once)
    extra = sum(2 if n.endswith("qkv_proj.weight") else 1 if n.endswith("gate_up_proj.weight")
                else 0 for n in names)
    assert len(model.expected_weights()) == len(names) + extra


def test_an_incomplete_model_cannot_be_built():
    class Partial(CausalLM):
        def forward(self, input_ids, positions, forward_batch):
            return input_ids

    with pytest.raises(TypeError, match="abstract"):
        Partial()
