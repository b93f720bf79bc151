"""The accelerator's torch module (``torch.cuda`` or ``torch.xpu``) and the calls on it that
the rest of the device package needs below its front module (``graphs.py`` recovers from a
failed capture with them)."""

from __future__ import annotations

import torch


def _mod(device_type: str):
    if device_type == "cuda":
        return torch.cuda
    if device_type == "xpu":
        return torch.xpu
    return None


def synchronize(device_type: str) -> None:
    mod = _mod(device_type)
    if mod is not None:
        mod.synchronize()


def empty_cache(device_type: str) -> None:
    mod = _mod(device_type)
    if mod is not None:
        mod.empty_cache()
