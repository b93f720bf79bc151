"""Model layers. ``set_fused_ops`` switches the Triton fused ops (RMSNorm + residual,
SiLU-and-mul, rotary) on for tensors on an accelerator; the CPU always runs eager torch."""

_FUSED = {"enabled": True}


def set_fused_ops(enabled: bool) -> None:
    """Use the Triton fused ops on cuda/xpu tensors (default on)."""
    _FUSED["enabled"] = bool(enabled)


def fused_ops_on(x) -> bool:
    """True when ``x`` lives on an accelerator and the fused ops are enabled."""
    return _FUSED["enabled"] and x.device.type != "cpu"
