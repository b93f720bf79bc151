"""Attention backends behind one interface (:class:`~engine.attention.base.AttentionBackend`).

  torch_native  the pure-torch reference kernels (``kernels/reference.py``); the CPU default
  triton        the Triton kernels in ``kernels/``; the CUDA and XPU default (for a model of
                latent-attention layers, DeepSeek's MLA: ``triton_mla.TritonMLABackend``,
                the kernels of ``kernels/mla/``)

``--attention-backend`` picks one; without it, ``engine.device.default_attention_backend``
picks by device. Adding a backend is one file (a subclass of ``AttentionBackend`` in this
folder) plus one line in ``ATTENTION_BACKENDS``.

Triton on the CPU: the kernels run there only in Triton's interpreter, which is slow and
for tests; :func:`create_attention_backend` refuses ``triton`` on the CPU unless
``TRITON_INTERPRET=1`` is set.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from engine import device as dev
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_native import TorchNativeAttnBackend
from engine.attention.triton import TritonAttnBackend, TritonMetadata
from engine.attention.triton_mla import TritonMLABackend
from engine.layer_spec import AttentionKind, LayerSpec

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch_native": TorchNativeAttnBackend,
    "triton": TritonAttnBackend,
}


def resolve_attention_backend(name: str | None, device_type: str) -> str:
    """The backend name to use: ``name``, or the device's default when None.

    Args:
        name: a key of ``ATTENTION_BACKENDS``, or None.
        device_type: ``cuda``, ``xpu`` or ``cpu``.
    Raises:
        ValueError: an unknown name (the message lists the choices), or ``triton`` on the
            CPU without ``TRITON_INTERPRET=1``.
    """
    if name is None:
        return dev.default_attention_backend(device_type)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of "
                         f"{', '.join(sorted(ATTENTION_BACKENDS))}")
    if name == "triton" and not dev.is_accelerator(device_type) \
            and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton needs a CUDA or XPU device; on the CPU "
                         "use torch_native (Triton runs there only under TRITON_INTERPRET=1, "
                         "for tests)")
    return name


def create_attention_backend(name: str | None, num_heads: int, num_kv_heads: int,
                             head_dim: int, *, device_type: str = "cpu",
                             device: str | torch.device | None = None, num_sms: int = 1,
                             waves: int | None = None,
                             fused_ops: bool = True,
                             layer_specs: Sequence[LayerSpec] | None = None,
                             kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """Build a backend by name (see :func:`resolve_attention_backend` for None).

    Args:
        name: ``torch_native``, ``triton`` or None (the device default).
        num_heads, num_kv_heads, head_dim: per-rank attention shape (Hq, Hkv, D).
        device_type: ``cuda``, ``xpu`` or ``cpu``.
        device: where static graph buffers live (default: ``device_type``).
        num_sms, waves: device compute units and programs per unit (split-KV decode);
            ``waves`` None is the kernel's default for the device type.
        fused_ops: False (``--disable-fused-ops``) keeps ``torch_native`` on the torch
            references on the CPU instead of ferry's C++ decode kernel.
        layer_specs: the model's layers, this rank's (``CausalLM.layer_specs`` through
            ``LayerSpec.per_rank``), which the backend checks it can run; None: unchecked.
        kv_dtype: the KV pool's dtype; the latent (MLA) backend picks its decode launch
            configuration by it (None: 16-bit). The other backends ignore it.
    Raises:
        ValueError: as :func:`resolve_attention_backend`; or Hq not a multiple of Hkv.
        NotImplementedError: a layer the backend does not run (a window, soft-capping,
            sinks, latent or linear attention), named in one line.
        ImportError: ``triton`` without an importable Triton.
    """
    cls = ATTENTION_BACKENDS[resolve_attention_backend(name, device_type)]
    if cls is TritonAttnBackend and any(s.attention == AttentionKind.LATENT
                                        for s in layer_specs or ()):
        cls = TritonMLABackend
    extra = {"fused_ops": fused_ops} if cls is TorchNativeAttnBackend else {}
    if cls is TritonMLABackend:
        extra = {"kv_dtype": kv_dtype}
    return cls(num_heads, num_kv_heads, head_dim, device=device or device_type,
               num_sms=num_sms, waves=waves, layer_specs=layer_specs, **extra)


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchNativeAttnBackend",
    "TritonAttnBackend",
    "TritonMLABackend",
    "TritonMetadata",
    "create_attention_backend",
    "resolve_attention_backend",
]
