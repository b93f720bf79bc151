"""Reading a peft LoRA adapter directory: ``adapter_config.json`` plus
``adapter_model.safetensors`` (or ``adapter_model.bin``).

peft saves ``lora_A`` as ``[r, in_features]`` and ``lora_B`` as ``[out_features, r]`` under
the base model's module names with a ``base_model.model.`` prefix
(``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``; a vision-language
model's language layers as transformers 5 names them, ``model.language_model.layers.3...``,
or as older ones did, ``language_model.model.layers.3...``, are read as ``model.layers.3...``,
ferry's names for them). The forward of a
LoRA linear layer is ``W x + scale * B (A x)`` with ``scale = lora_alpha / r`` (rsLoRA,
``use_rslora``: ``lora_alpha / sqrt(r)``; Kalajdzievski 2023); a module of ``rank_pattern``
has its own r, read here from its tensors. What ferry does not run is refused with the
config field or tensor that asks for it: DoRA (``use_dora``), ``modules_to_save``, adapters
on the embeddings or the LM head, LoRA biases (``bias``), ``alpha_pattern``, non-LoRA peft
types, modules other than the seven projections q/k/v/o/gate/up/down, and modules of a
vision tower.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

#: the projections an adapter may target (HF module names of Llama-family layers)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?"
                  r"(?:model\.language_model\.|language_model\.model\.|model\.)"
                  r"(layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))"
                  r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter ferry cannot serve; ``param`` names the request or config field, ``status``
    the HTTP status (400 a bad adapter, 404 an unknown name)."""

    def __init__(self, message: str, param: str = "lora_path", status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class LoRAAdapter:
    """An adapter in host memory.

    Attributes:
        name: the name requests use; path: its directory.
        rank: the largest r over its modules.
        weights: HF module name (``model.layers.3.self_attn.q_proj``) -> ``(A [r, K],
            B [N, r] * scale)``, float32 CPU tensors.
    """

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def _config_errors(cfg: dict) -> None:
    def bad(f: str, why: str) -> LoRAError:
        return LoRAError(f"adapter_config.json: {f}: {why}", "lora_path")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"{cfg['peft_type']!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise bad("use_dora", "DoRA adapters are not supported")
    if cfg.get("modules_to_save"):
        raise bad("modules_to_save", f"{cfg['modules_to_save']} is not supported (only LoRA "
                  "deltas on the q/k/v/o/gate/up/down projections)")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", f"{cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("alpha_pattern"):
        raise bad("alpha_pattern", "per-module lora_alpha is not supported")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    for t in targets:
        if any(w in t for w in ("embed", "lm_head", "wte", "output")):
            raise bad("target_modules", f"{t!r}: adapters on the embeddings or the LM head are "
                      "not supported")
    for f in ("r", "lora_alpha"):
        v = cfg.get(f)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise bad(f, f"must be a positive number, got {v!r}")


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        try:
            return load_file(st, device="cpu")
        except Exception as e:  # a corrupt or truncated file
            raise LoRAError(f"{st}: not a readable safetensors file ({e})") from None
    bn = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bn):
        try:
            return torch.load(bn, map_location="cpu", weights_only=True)
        except Exception as e:
            raise LoRAError(f"{bn}: not a readable torch file ({e})") from None
    raise LoRAError(f"{path}: no adapter_model.safetensors or adapter_model.bin")


def adapter_rank(path: str) -> int:
    """The largest rank an adapter directory declares (``r`` and ``rank_pattern``), from its
    config alone; 0 when it cannot be read (:func:`read_adapter` then says why)."""
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        ranks = [cfg.get("r", 0)] + list((cfg.get("rank_pattern") or {}).values())
        return max(int(r) for r in ranks if isinstance(r, (int, float)))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def read_adapter_config(path: str) -> dict:
    """The checked ``adapter_config.json`` of an adapter directory (no tensors are read).

    Raises:
        LoRAError: no such directory, no or malformed ``adapter_config.json``, or a config
            asking for what ferry does not run (naming the field).
    """
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter path {path!r} is not a directory")
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{path}: no adapter_config.json (not a peft adapter)") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_path}: not a JSON object")
    _config_errors(cfg)
    return cfg


def check_adapter_dir(path: str, max_rank: int | None) -> None:
    """What can be checked of an adapter directory without reading its tensors: the config
    (:func:`read_adapter_config`), a weights file, and the declared rank (``r``,
    ``rank_pattern``) against ``max_rank`` (``--max-lora-rank``; None: not given). For
    ``ferry serve``'s start-up checks; :func:`read_adapter` checks the tensors too.

    Raises:
        LoRAError: as :func:`read_adapter_config`; no ``adapter_model.safetensors`` or
            ``adapter_model.bin``; a declared rank above ``max_rank``.
    """
    read_adapter_config(path)
    if not any(os.path.isfile(os.path.join(path, f))
               for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise LoRAError(f"{path}: no adapter_model.safetensors or adapter_model.bin")
    rank = adapter_rank(path)
    if max_rank is not None and rank > max_rank:
        raise LoRAError(f"{path}: rank {rank} (adapter_config.json), above --max-lora-rank "
                        f"{max_rank}", "r")


def read_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """Read and check a peft LoRA adapter directory.

    Returns:
        the adapter with every module's ``(A, scale * B)`` in float32 on the CPU.
    Raises:
        LoRAError: no such directory, a missing or malformed file, an unsupported feature
            (naming the config field or the tensor), or a module rank above ``max_rank``
            (``--max-lora-rank``).
    """
    cfg = read_adapter_config(path)
    alpha, rslora = float(cfg["lora_alpha"]), bool(cfg.get("use_rslora"))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _read_tensors(path).items():
        m = _KEY.match(key)
        if m is None:
            what = ("DoRA magnitude (use_dora)" if "lora_magnitude" in key else
                    "an embedding or LM head adapter" if ("embed" in key or "lm_head" in key)
                    else "a vision-tower adapter (the language layers' projections only)"
                    if "visual." in key
                    else "not a LoRA A/B weight of a supported projection")
            raise LoRAError(f"adapter tensor {key!r}: {what}")
        module, kind = "model." + m.group(1), m.group(3)
        if kind not in LORA_MODULES:
            raise LoRAError(f"adapter tensor {key!r}: module {kind!r} is not supported "
                            f"(target_modules among {', '.join(LORA_MODULES)})")
        if t.dim() != 2 or not t.is_floating_point():
            raise LoRAError(f"adapter tensor {key!r}: expected a 2-D float matrix, got "
                            f"{tuple(t.shape)} {t.dtype}")
        parts.setdefault(module, {})[m.group(4)] = t
    if not parts:
        raise LoRAError(f"{path}: the adapter has no LoRA weights")
    adapter = LoRAAdapter(name, path, 0)
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{path}: {module} has lora_{'A' if 'A' in ab else 'B'} without "
                            f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        if b.shape[1] != r:
            raise LoRAError(f"{path}: {module}: lora_A has rank {r}, lora_B {b.shape[1]}")
        if r > max_rank:
            raise LoRAError(f"{path}: {module} has rank {r}, above --max-lora-rank "
                            f"{max_rank}", "r")
        scale = alpha / (math.sqrt(r) if rslora else r)
        adapter.weights[module] = (a.contiguous(), (b * scale).contiguous())
        adapter.rank = max(adapter.rank, r)
    return adapter
