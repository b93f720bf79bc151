"""Tiny random checkpoints with an MTP layer (``--speculative-algorithm MTP``): HF's classes
ignore the MTP layer, so the tests add its tensors to the saved safetensors themselves.

- :func:`add_deepseek_mtp`: DeepSeek-V3's ``model.layers.{L}.*`` (``enorm``, ``hnorm``,
  ``eh_proj``, a decoder layer copied from the checkpoint's last MoE layer and perturbed,
  ``shared_head.norm``/``head``, ``embed_tokens``).
- :func:`add_qwen_mtp`: Qwen3-Next's ``mtp.*`` (``pre_fc_norm_*``, ``fc``, ``layers.0.*``
  copied from a full-attention layer and perturbed, ``norm``).
- ``oracle``: an arranged MTP layer that predicts exactly what the target will: the
  target's token mixers and MLPs are zeroed (its next token is a function of the current
  token only), and the MTP layer passes the next token's embedding through (``proj`` =
  ``[I | 0]``, its own mixer and MLP zeroed, the target's final norm), so every draft is
  the target's own choice and must be accepted.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

#: tensors whose zeroing silences a layer's token mixer or MLP (their output projections)
_SILENCE = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "w2_weight")


def _file(path) -> str:
    return os.path.join(str(path), "model.safetensors")


def _randn(shape, g, scale=0.1):
    return scale * torch.randn(shape, generator=g)


def _save(path, tensors: dict, config_updates: dict) -> None:
    save_file(tensors, _file(path), metadata={"format": "pt"})
    cfg_path = os.path.join(str(path), "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(config_updates)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def _silence(tensors: dict) -> None:
    for name in list(tensors):
        if name.endswith(_SILENCE):
            tensors[name] = torch.zeros_like(tensors[name])


def add_deepseek_mtp(path, oracle: bool = False, seed: int = 7) -> None:
    """Append a DeepSeek-V3 MTP layer to the checkpoint at ``path`` (``oracle``: the
    arranged one of the module docstring, the target silenced too)."""
    t = load_file(_file(path))
    with open(os.path.join(str(path), "config.json")) as f:
        n = json.load(f)["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    src, dst = f"model.layers.{n - 1}.", f"model.layers.{n}."
    h = t["model.embed_tokens.weight"].shape[1]
    for name in [k for k in t if k.startswith(src)]:
        w = t[name]
        t[dst + name[len(src):]] = w + (0 if "norm" in name else _randn(w.shape, g, 0.05))
    t[dst + "enorm.weight"] = 1.0 + _randn((h,), g)
    t[dst + "hnorm.weight"] = 1.0 + _randn((h,), g)
    t[dst + "eh_proj.weight"] = _randn((h, 2 * h), g)
    t[dst + "shared_head.norm.weight"] = 1.0 + _randn((h,), g)
    t[dst + "shared_head.head.weight"] = t["lm_head.weight"].clone()
    t[dst + "embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    if oracle:
        _silence(t)
        t[dst + "enorm.weight"] = torch.ones(h)
        t[dst + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        t[dst + "shared_head.norm.weight"] = t["model.norm.weight"].clone()
    _save(path, t, {"num_nextn_predict_layers": 1})


def add_qwen_mtp(path, full_layer: int, oracle: bool = False, seed: int = 7) -> None:
    """Append a Qwen3-Next MTP layer (``mtp.*``) to the checkpoint at ``path``, its decoder
    layer copied from layer ``full_layer`` (a full-attention layer)."""
    t = load_file(_file(path))
    g = torch.Generator().manual_seed(seed)
    src = f"model.layers.{full_layer}."
    h = t["model.embed_tokens.weight"].shape[1]
    for name in [k for k in t if k.startswith(src)]:
        w = t[name]
        t["mtp.layers.0." + name[len(src):]] = w + (0 if "norm" in name
                                                     else _randn(w.shape, g, 0.05))
    t["mtp.pre_fc_norm_embedding.weight"] = _randn((h,), g)   # (1 + w) norms
    t["mtp.pre_fc_norm_hidden.weight"] = _randn((h,), g)
    t["mtp.fc.weight"] = _randn((h, 2 * h), g)
    t["mtp.norm.weight"] = _randn((h,), g)
    if oracle:
        _silence(t)
        t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)
        t["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        t["mtp.norm.weight"] = t["model.norm.weight"].clone()
    _save(path, t, {"mtp_num_hidden_layers": 1})
