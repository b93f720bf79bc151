"""MXFP4 (OCP microscaling FP4) expert weights in torch: the block layout gpt-oss checkpoints
ship, dequantization (the reference and ferry's CPU path) and quantization (tests, dummy
weights).

Layout (transformers 5.24's ``integrations/mxfp4.py``): a weight ``W [N, K]`` (N output rows,
K the reduced axis, a multiple of 32) is stored as

    blocks [..., N, K / 32, 16] uint8   two e2m1 codes a byte: element 2j in the low nibble,
                                        element 2j + 1 in the high nibble
    scales [..., N, K / 32]     uint8   e8m0: the block of 32 elements is scaled by
                                        2 ** (scale - 127)

An e2m1 code ``s eem`` is ``(-1)^s * {0, 0.5, 1, 1.5, 2, 3, 4, 6}[eem]``
(:data:`E2M1_VALUES`). 32 four-bit values and one byte of scale: 4.25 bits a weight.

The checkpoint's ``gate_up_proj_blocks`` is ``[E, 2I, H/32, 16]`` (rows alternate gate, up:
HF's ``[..., ::2]``/``[..., 1::2]``), ``down_proj_blocks`` ``[E, H, I/32, 16]``: the rows are
the output features, which is ferry's ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` orientation.
"""

from __future__ import annotations

import torch

#: the value of each e2m1 code 0..15
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: elements per scale
MXFP4_BLOCK = 32
#: the e8m0 exponent bias
SCALE_BIAS = 127


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Raises ValueError unless ``blocks [..., N, G, 16]`` and ``scales [..., N, G]`` are
    uint8 of matching shapes."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, "
                         f"{scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != MXFP4_BLOCK // 2 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks [..., N, G, 16] and scales [..., N, G] expected, got "
                         f"{tuple(blocks.shape)}, {tuple(scales.shape)}")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [..., N, G, 16]``, ``scales [..., N, G]`` (uint8) -> ``[..., N, G * 32]`` in
    ``dtype`` (exact in fp32 and bf16: every value is a small power-of-two multiple).

    Raises:
        ValueError: see :func:`check_mxfp4`.
    """
    check_mxfp4(blocks, scales)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).flatten(-2)                  # [..., N, G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - SCALE_BIAS)[..., None])
    return vals.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``w [..., N, K]`` (K a multiple of 32) to MXFP4: per block of 32 the scale
    ``2 ** (floor(log2(amax)) - 2)`` (the largest element lands in [4, 8) before rounding,
    clamped to 6), each element to the nearest e2m1 value.

    Returns:
        ``(blocks [..., N, K/32, 16] uint8, scales [..., N, K/32] uint8)``.
    Raises:
        ValueError: K not a multiple of 32.
    """
    *lead, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the reduced axis a multiple of 32, got {k}")
    x = w.float().reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = x.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -120)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-SCALE_BIAS, 127)
    y = x / torch.exp2(exp)
    lut = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    code = (y.abs()[..., None] - lut).abs().argmin(-1)                # nearest magnitude
    code = code | ((y < 0) & (code > 0)).long() << 3
    pairs = code.reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = (exp.squeeze(-1) + SCALE_BIAS).to(torch.uint8)
    return blocks, scales


def dummy_mxfp4(u: torch.Tensor, scale_exp: int = -6) -> tuple[torch.Tensor, torch.Tensor]:
    """Dummy MXFP4 bytes from uniform noise: ``u`` of the blocks' shape (values in
    ``[-a, a)``, any float) becomes random bytes; the scales are ``127 + scale_exp`` plus
    or minus one, from the noise of the first nibble column (values of about
    ``2 ** scale_exp``, weights of std ~0.05 at the default).

    Returns:
        ``(blocks uint8 [u.shape], scales uint8 [u.shape[:-1]])``.
    """
    span = u.abs().amax().clamp_min(1e-12)
    blocks = ((u / span + 1) * 127.999).clamp(0, 255).to(torch.uint8)
    jitter = (u[..., 0] / span * 1.5).round().clamp(-1, 1)
    scales = (jitter + SCALE_BIAS + scale_exp).to(torch.uint8)
    return blocks, scales


__all__ = ["E2M1_VALUES", "MXFP4_BLOCK", "SCALE_BIAS", "check_mxfp4", "dequantize_mxfp4",
           "dummy_mxfp4", "quantize_mxfp4"]
