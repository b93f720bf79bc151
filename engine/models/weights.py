"""HF checkpoint names and the loading helpers the decoders share.

ferry fuses the q/k/v projections (``self_attn.qkv_proj``) and the gate/up projections
(``mlp.gate_up_proj``); :data:`STACKED_PARAMS` maps each fused parameter to its checkpoint
parts and shard ids (the loader, the quantization methods, LoRA and EAGLE read it).

FP8 checkpoints add ``<module>.weight_scale`` tensors, loaded like the weights onto the
fused ``...qkv_proj.weight_scale`` / ``...gate_up_proj.weight_scale`` (same shard ids);
their static ``input_scale`` (and KV ``k_scale``/``v_scale``) tensors are skipped
(:data:`STATIC_SCALE_SUFFIXES`).
"""

from __future__ import annotations

import torch

#: (ferry fused param, HF checkpoint part, shard id)
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# checkpoint tensors that are not weights (precomputed RoPE tables)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# FP8 checkpoints' static activation and KV scales: activations are quantized per token at
# run time, the KV cache format is --kv-cache-dtype (engine.layers.quantization)
STATIC_SCALE_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".kv_scale")


def load_tensor(name: str, loader, param: torch.Tensor, tensor, *shard) -> None:
    """``loader(param, tensor, *shard)``; a ValueError names the checkpoint tensor ``name``.

    Raises:
        ValueError: the loader's (a shape mismatch), prefixed with ``name``.
    """
    try:
        loader(param, tensor, *shard)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def check_fp8(name: str, param: torch.Tensor, tensor) -> None:
    """Refuse an FP8 checkpoint tensor for a parameter that is not FP8.

    Raises:
        ValueError: ``tensor`` is float8_e4m3fn and ``param`` is not (names the tensor).
    """
    fp8 = torch.float8_e4m3fn
    if getattr(tensor, "dtype", None) == fp8 and param.dtype != fp8:
        raise ValueError(f"{name} is FP8 in the checkpoint, but ferry loads it as "
                         f"{str(param.dtype).removeprefix('torch.')}: FP8 linear weights need "
                         "the checkpoint's quantization_config (their scales), and FP8 "
                         "embeddings, norms and LM heads are not supported")
