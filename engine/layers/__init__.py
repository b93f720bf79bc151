"""Model layers.

The small ops (RMSNorm with the residual add, SiLU-and-mul, rotary) each hold their
implementation in an ``impl`` attribute: the eager torch reference from
:mod:`kernels.reference` by default, or the Triton kernel from :mod:`kernels.fused_ops` /
:mod:`kernels.rotary`. :func:`select_ops` chooses once per model, after loading; no op looks
at a flag or at its tensor's device when it is called.
"""

from __future__ import annotations


def op_implementations(fused: bool) -> dict:
    """The implementation each small-op module class gets: ``{class: function}``.

    Args:
        fused: True for the Triton kernels (``rms_norm``, ``silu_and_mul``,
            ``rotary_inplace``), False for the eager references (``rms_norm_ref``,
            ``silu_and_mul_ref``, ``rotary_ref``).
    Raises:
        ImportError: ``fused`` without an importable ``triton``.
    """
    from engine.layers.activation import SiluAndMul
    from engine.layers.norm import RMSNorm
    from engine.layers.rotary import RotaryEmbedding

    if fused:
        from kernels.fused_ops import rms_norm, silu_and_mul
        from kernels.rotary import rotary_inplace

        return {RMSNorm: rms_norm, SiluAndMul: silu_and_mul, RotaryEmbedding: rotary_inplace}
    from kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref

    return {RMSNorm: rms_norm_ref, SiluAndMul: silu_and_mul_ref, RotaryEmbedding: rotary_ref}


def select_ops(model, fused: bool) -> int:
    """Choose, once for ``model``, the fused Triton or the eager torch small ops.

    Walks ``model.modules()`` and sets ``impl`` on every ``RMSNorm``, ``SiluAndMul`` and
    ``RotaryEmbedding``. The choice belongs to the model, not the process, so a CPU model
    and a CUDA model can live side by side (``ferry parity --devices cpu,cuda``). The caller
    decides from the device once: ``ModelRunner`` passes
    ``not args.disable_fused_ops and engine.device.use_triton(device)``. Fused ops on a CPU
    model only run under ``TRITON_INTERPRET=1`` (the kernel tests).

    Args:
        model: an ``nn.Module`` (built and loaded; call again before capturing graphs if the
            choice changes, since graphs record the kernels that ran).
        fused: True for the Triton kernels, False for the eager references.
    Returns:
        The number of modules set (0: the model has none of these ops).
    Raises:
        ImportError: ``fused`` without an importable ``triton``.
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
