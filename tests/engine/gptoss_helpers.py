"""Tiny random gpt-oss checkpoints for the tests: float experts (HF's ``save_pretrained``
layout) and MXFP4 experts (``*_blocks``/``*_scales`` in the shipped block layout, quantized
here from the random weights; the HF reference model then holds the dequantized values)."""

from __future__ import annotations

import json

import torch
from moe_helpers import save_char_tokenizer

from kernels.moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def gptoss_config(**over):
    from transformers import GptOssConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=64, head_dim=16,
              num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
              num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
              max_position_embeddings=512, swiglu_limit=1.0,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "rope_theta": 1000.0,
                               "original_max_position_embeddings": 64},
              attn_implementation="eager", bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
    kw.update(over)
    return GptOssConfig(**kw)


def _randomise(hf, seed: int = 99) -> None:
    """Norms 1 + 0.1 N(0, 1); sinks N(0, 1) (so that they matter); the rest 0.1 N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("sinks"):
                p.copy_(noise)
            else:
                p.copy_(0.1 * noise)


def save_tiny_gptoss(path, mxfp4: bool = False, **over) -> torch.nn.Module:
    """Build, randomise and save a tiny gpt-oss (with the character tokenizer); with
    ``mxfp4`` the experts are rounded to MXFP4 first (the HF model keeps the rounded float
    values) and written as blocks and scales with ``quantization_config: mxfp4``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(gptoss_config(**over), dtype=torch.float32).eval()
    _randomise(hf)
    packed = {}
    if mxfp4:
        with torch.no_grad():
            for i, layer in enumerate(hf.model.layers):
                ex = layer.mlp.experts
                for part in ("gate_up_proj", "down_proj"):
                    w = getattr(ex, part)                      # [E, K, N]
                    blocks, scales = quantize_mxfp4(w.transpose(1, 2))
                    w.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
                    key = f"model.layers.{i}.mlp.experts.{part}"
                    packed[f"{key}_blocks"], packed[f"{key}_scales"] = blocks, scales
    hf.save_pretrained(path)
    save_char_tokenizer(path)
    if mxfp4:
        f = path / "model.safetensors"
        tensors = {k: v for k, v in load_file(f).items()
                   if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        save_file({**tensors, **packed}, f, metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
        (path / "config.json").write_text(json.dumps(cfg))
    return hf
