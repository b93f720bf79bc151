"""Model layers.

The small ops (RMSNorm with the residual add, SiLU-and-mul, rotary) each hold their
implementation in an ``impl`` attribute: the eager torch reference from
:mod:`kernels.reference` by default, the Triton kernel from :mod:`kernels.fused_ops` /
:mod:`kernels.rotary` on GPUs, or ferry's C++ kernel from :mod:`kernels.cpu_ops` on the CPU.
The MoE experts (``engine.layers.moe.FusedMoE``) too: :mod:`kernels.moe.fused_moe` (Triton) on
GPUs, :func:`kernels.moe.reference.fused_moe_torch` otherwise.
:func:`select_ops` chooses once per model, after loading; no op looks at a flag or at its
tensor's device when it is called.
"""

from __future__ import annotations

#: the small-op implementation kinds (:func:`op_implementations`)
OP_KINDS = ("triton", "cpu", "reference")


def small_ops_kind(device_type: str, disable_fused_ops: bool = False) -> str:
    """The kind a model on ``device_type`` gets: ``triton`` on GPUs, ``cpu`` on the CPU when
    ferry's C++ kernels build (:func:`kernels.cpu_ops.load`), else ``reference``; always
    ``reference`` with ``disable_fused_ops`` (``--disable-fused-ops``)."""
    from engine import device as dev

    if disable_fused_ops:
        return "reference"
    if dev.use_triton(device_type):
        return "triton"
    if device_type == "cpu":
        from kernels import cpu_ops

        if cpu_ops.load():
            return "cpu"
    return "reference"


def op_implementations(fused: bool | str) -> dict:
    """The implementation each small-op module class gets: ``{class: function}``.

    Args:
        fused: ``"triton"`` (or True) for the Triton kernels (``rms_norm``,
            ``gemma_rms_norm``, ``gated_rms_norm``, ``silu_and_mul``, ``rotary_inplace``),
            ``"cpu"`` for the C++ CPU kernels of the same names (the eager references of
            the two norms that have none: ``gemma_rms_norm_ref``, ``gated_rms_norm_ref``),
            ``"reference"`` (or False) for the eager references (``rms_norm_ref``,
            ``silu_and_mul_ref``, ``rotary_ref``, ...).
    Raises:
        ImportError: ``triton`` without an importable ``triton``.
        RuntimeError: ``cpu`` where the C++ kernels do not build.
        ValueError: an unknown kind.
    """
    from engine.layers.activation import SiluAndMul
    from engine.layers.moe import FusedMoE, triton_fused_moe
    from engine.layers.norm import GatedRMSNorm, GemmaRMSNorm, RMSNorm
    from engine.layers.rotary import RotaryEmbedding
    from kernels.moe.reference import fused_moe_torch
    from kernels.reference import (
        gated_rms_norm_ref,
        gemma_rms_norm_ref,
        rms_norm_ref,
        rotary_ref,
        silu_and_mul_ref,
    )

    kind = {True: "triton", False: "reference"}.get(fused, fused)
    if kind not in OP_KINDS:
        raise ValueError(f"unknown small-op kind {fused!r}; choose one of {', '.join(OP_KINDS)}")
    if kind == "cpu":
        from kernels import cpu_ops

        if not cpu_ops.load():
            raise RuntimeError("ferry's C++ CPU kernels are not available (see the log)")
        return {RMSNorm: cpu_ops.rms_norm, SiluAndMul: cpu_ops.silu_and_mul,
                RotaryEmbedding: cpu_ops.rotary_inplace, FusedMoE: fused_moe_torch,
                GemmaRMSNorm: gemma_rms_norm_ref, GatedRMSNorm: gated_rms_norm_ref}
    if kind == "triton":
        from kernels.fused_ops import gated_rms_norm, gemma_rms_norm, rms_norm, silu_and_mul
        from kernels.rotary import rotary_inplace

        return {RMSNorm: rms_norm, SiluAndMul: silu_and_mul, RotaryEmbedding: rotary_inplace,
                FusedMoE: triton_fused_moe(), GemmaRMSNorm: gemma_rms_norm,
                GatedRMSNorm: gated_rms_norm}
    return {RMSNorm: rms_norm_ref, SiluAndMul: silu_and_mul_ref, RotaryEmbedding: rotary_ref,
            FusedMoE: fused_moe_torch, GemmaRMSNorm: gemma_rms_norm_ref,
            GatedRMSNorm: gated_rms_norm_ref}


def select_ops(model, fused: bool | str) -> int:
    """Choose, once for ``model``, the fused Triton, the C++ CPU or the eager torch small ops.

    Walks ``model.modules()`` and sets ``impl`` on every ``RMSNorm``, ``SiluAndMul``,
    ``RotaryEmbedding``, ``GemmaRMSNorm``, ``GatedRMSNorm`` and ``FusedMoE``. The choice belongs to the model, not the process,
    so a CPU model and a CUDA model can live side by side (``ferry parity --devices
    cpu,cuda``). The caller decides from the device once: ``ModelRunner`` passes
    :func:`small_ops_kind`. Triton ops on a CPU model only run under ``TRITON_INTERPRET=1``
    (the kernel tests).

    Args:
        model: an ``nn.Module`` (built and loaded; call again before capturing graphs if the
            choice changes, since graphs record the kernels that ran).
        fused: a kind of :func:`op_implementations` (True/False: triton/reference).
    Returns:
        The number of modules set (0: the model has none of these ops).
    Raises:
        as :func:`op_implementations`.
    """
    impls = tuple(op_implementations(fused).items())
    n = 0
    for m in model.modules():
        for cls, fn in impls:
            if isinstance(m, cls):
                m.impl = fn
                n += 1
                break
    return n
