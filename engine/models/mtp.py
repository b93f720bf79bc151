"""Where checkpoints keep their multi-token-prediction (MTP) layer, and how a one-layer
model of the target's class loads it (``--speculative-algorithm MTP``; the proposer is
``engine/speculative/mtp.py``, whose docstring describes the layer).

- DeepSeek-V3 (``num_nextn_predict_layers`` >= 1): ``model.layers.{L}.`` with ``L`` =
  ``num_hidden_layers``: ``enorm``, ``hnorm``, ``eh_proj`` ``[H, 2H]``, the decoder layer's
  own tensors (MLA, MoE), ``shared_head.norm``; ``embed_tokens`` and ``shared_head.head``
  (copies of the target's) are skipped.
- Qwen3-Next / Qwen3.5 (``mtp_num_hidden_layers`` >= 1): ``mtp.``: ``pre_fc_norm_embedding``,
  ``pre_fc_norm_hidden``, ``fc`` ``[H, 2H]``, ``layers.0.*`` (a gated full-attention layer;
  MoE in the MoE models), ``norm``.

Only the first MTP layer is used. The preflight (``engine/executor/preflight.py``) asks
:func:`mtp_refusal` before any process starts.
"""

from __future__ import annotations

import copy
import glob
import json
import os
from dataclasses import dataclass

import torch

#: the vocabulary of the one-layer model (its embedding and LM head are never read: the
#: target's are)
MINI_VOCAB = 8
#: the MTP layer's input tensors per style: (embedding norm, hidden norm, projection)
MTP_INPUT_NAMES = {"deepseek": ("enorm", "hnorm", "eh_proj"),
                   "qwen3_next": ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc")}


@dataclass(frozen=True)
class MtpLayout:
    """Where a checkpoint keeps its MTP layer.

    Attributes:
        style: ``"deepseek"`` or ``"qwen3_next"`` (the module docstring's layouts).
        prefix: the checkpoint names' prefix of the layer (``model.layers.61.``, ``mtp.``).
        declared: MTP layers the config declares (0: none).
    """

    style: str
    prefix: str
    declared: int


def _text(config):
    return getattr(config, "text_config", None) or config


def mtp_layout(model_cls, config) -> MtpLayout | None:
    """The MTP layout of a model class (its ``mtp_style``) and HF config; None for a family
    without MTP layers."""
    style = getattr(model_cls, "mtp_style", None)
    text = _text(config)
    if style == "deepseek":
        n = getattr(text, "num_nextn_predict_layers", None) or 0
        return MtpLayout(style, f"model.layers.{text.num_hidden_layers}.", int(n))
    if style == "qwen3_next":
        n = getattr(text, "mtp_num_hidden_layers", None) or \
            getattr(config, "mtp_num_hidden_layers", None) or 0
        return MtpLayout(style, "mtp.", int(n))
    return None


def checkpoint_names(path: str) -> list[str] | None:
    """The tensor names of the safetensors checkpoint at ``path`` (from its index, else the
    files' headers; no tensor is read); None where ``path`` holds no safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return list(json.load(f).get("weight_map", {}))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    names: list[str] = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def mtp_refusal(model_cls, config, path: str | None, dummy: bool) -> str | None:
    """Why ``--speculative-algorithm MTP`` cannot run on this model, or None.

    Args:
        model_cls: the target's class; config: its HF config.
        path: the checkpoint directory holding the MTP layer (the target's, or
            ``--speculative-draft-model-path``); dummy: ``--load-format dummy`` (the config
            must declare the layer; its weights are drawn).
    """
    layout = mtp_layout(model_cls, config)
    name = model_cls.__name__
    if layout is None:
        return f"{name} has no multi-token-prediction layer (MTP: DeepSeek-V3, Qwen3-Next, Qwen3.5)"
    if getattr(_text(config), "mtp_use_dedicated_embeddings", False):
        return f"{name}: an MTP layer with its own embeddings (mtp_use_dedicated_embeddings) " \
               "is not supported"
    if dummy:
        if layout.declared < 1:
            field = "num_nextn_predict_layers" if layout.style == "deepseek" \
                else "mtp_num_hidden_layers"
            return f"{name}: the config declares no MTP layer ({field})"
        return None
    names = checkpoint_names(path) if path and os.path.isdir(path) else None
    first = MTP_INPUT_NAMES[layout.style][2] + ".weight"
    if not names or layout.prefix + first not in names:
        return f"{name}: the checkpoint {path} has no MTP layer ({layout.prefix}{first})"
    return None


def mtp_layer_is_moe(config) -> bool:
    """Whether the MTP layer has the MoE MLP (the rule of the target's layers, applied to
    layer index ``num_hidden_layers``)."""
    from engine.models.config import ModelConfig

    return ModelConfig.from_hf(config).is_moe_layer(_text(config).num_hidden_layers)


def mini_config(config, layout: MtpLayout, moe: bool):
    """The target's HF config cut to one decoder layer shaped as the MTP layer (MoE or
    dense as ``moe`` says; Qwen's full attention), with a tiny vocabulary."""
    cfg = copy.deepcopy(config)
    for c in {id(cfg): cfg, id(_text(cfg)): _text(cfg)}.values():
        c.vocab_size = MINI_VOCAB
    text = _text(cfg)
    text.num_hidden_layers = 1
    if layout.style == "deepseek":
        text.first_k_dense_replace = 0 if moe else 1
        text.num_nextn_predict_layers = 0
    else:
        text.layer_types = ["full_attention"]
        text.mlp_only_layers = [] if moe else [0]
        text.decoder_sparse_step = 1
    return cfg


def mtp_weight_map(layout: MtpLayout, hidden: int, own: dict):
    """The ``weight_map`` of :func:`load_model` that picks the MTP layer out of the target's
    checkpoint: its decoder layer as ``model.layers.0.``, its final norm as ``model.norm``,
    placeholders for the one-layer model's unused embedding and LM head; the input
    tensors (``MTP_INPUT_NAMES``) go into ``own`` (name -> tensor, materialized)."""
    # (a block-FP8 checkpoint may keep the projection in e4m3 with its block scales)
    inputs = {f"{n}.{leaf}" for n in MTP_INPUT_NAMES[layout.style]
              for leaf in ("weight", "weight_scale_inv")}
    final = "shared_head.norm.weight" if layout.style == "deepseek" else "norm.weight"

    def run(weights):
        yield "model.embed_tokens.weight", torch.zeros(MINI_VOCAB, hidden)
        yield "lm_head.weight", torch.zeros(MINI_VOCAB, hidden)
        for name, tensor in weights:
            if not name.startswith(layout.prefix):
                continue
            rest = name[len(layout.prefix):]
            if rest in inputs:
                own[rest] = tensor if isinstance(tensor, torch.Tensor) else tensor.materialize()
            elif rest == final:
                yield "model.norm.weight", tensor
            elif (part := _layer_part(layout, rest)) is not None:
                yield "model.layers.0." + part, tensor
    return run


def _layer_part(layout: MtpLayout, rest: str) -> str | None:
    """The decoder layer's own name of MTP tensor ``rest`` (after the prefix), or None for
    one that is not the first layer's (DeepSeek's copies of the embedding and LM head, a
    second Qwen MTP layer)."""
    if layout.style == "deepseek":
        return None if rest.startswith(("embed_tokens.", "shared_head.")) else rest
    return rest[len("layers.0."):] if rest.startswith("layers.0.") else None


__all__ = ["MINI_VOCAB", "MTP_INPUT_NAMES", "MtpLayout", "checkpoint_names", "mini_config",
           "mtp_layer_is_moe", "mtp_layout", "mtp_refusal", "mtp_weight_map"]
