"""Weight-only quantized layouts (4-bit and 8-bit, grouped) and their torch references.

ferry keeps low-bit weights (GGUF Q4_0/Q4_1/Q8_0 blocks; AWQ and GPTQ groups) in one of two
layouts, whatever the checkpoint's own packing, so that one CPU kernel
(``kernels/cpu/wq.cpp``) and one Triton kernel (:mod:`kernels.quant.wq_triton`) serve them all.
A weight is ``W [N, K]`` (out, in); ``K`` is a multiple of 32 and of the group size ``G``
(32 for GGUF, 128 for AWQ/GPTQ):

``q4``  ``qweight`` uint8 ``[N, K / 2]``; every 32 weights of a row (a *chunk*) are 16
        bytes, byte ``j`` holding weight ``j`` of the chunk in its low nibble and weight
        ``j + 16`` in its high nibble (llama.cpp's Q4_0/Q4_1 order, so GGUF blocks repack by
        a copy); ``scales`` and ``mins`` ``[N, K / G]`` float16 or float32; the weight is
        ``scale * q + min`` with ``q`` in 0..15 (Q4_0: ``min = -8 * scale``; AWQ/GPTQ:
        ``min = -scale * zero``).
``q8``  ``qweight`` int8 ``[N, K]`` in order, ``scales`` ``[N, K / G]``: ``scale * q``.

Bytes per weight: q4 with fp16 scale and min and G = 32: 5/8 (Q4_1's own size); q8: 34/32.
The references dequantize in float32 (exact: an fp16 scale times a 4- or 8-bit integer, plus
an fp16 min, rounds nowhere in fp32) and multiply; the kernels must match them up to the
order of the fp32 sums.
"""

from __future__ import annotations

import torch

CHUNK = 32  # weights per 16-byte group of nibbles


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """Integers ``q [N, K]`` in 0..15 -> ``qweight [N, K / 2]`` uint8 in the q4 order."""
    n, k = q.shape
    if k % CHUNK:
        raise ValueError(f"q4 needs K a multiple of {CHUNK}, got {k}")
    c = q.to(torch.uint8).view(n, k // CHUNK, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_q4(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight [N, K / 2]`` uint8 -> ``q [N, K]`` uint8 in 0..15 (inverse of :func:`pack_q4`)."""
    n, half = qweight.shape
    b = qweight.view(n, half // 16, 16)
    return torch.cat([b & 0xF, b >> 4], dim=-1).reshape(n, half * 2)


def _expand(groups: torch.Tensor, k: int) -> torch.Tensor:
    """``[N, K / G]`` per-group values -> ``[N, K]`` float32."""
    return groups.float().repeat_interleave(k // groups.shape[1], dim=1)


def dequant_q4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale * q + min`` -> ``W [N, K]`` in ``dtype`` (computed in float32)."""
    q = unpack_q4(qweight).float()
    k = q.shape[1]
    return (q * _expand(scales, k) + _expand(mins, k)).to(dtype)


def dequant_q8(qweight: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale * q`` -> ``W [N, K]`` in ``dtype`` (computed in float32)."""
    return (qweight.float() * _expand(scales, qweight.shape[1])).to(dtype)


def dequant(fmt: str, qweight: torch.Tensor, scales: torch.Tensor,
            mins: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[N, K]`` of a ``q4`` or ``q8`` layout."""
    if fmt == "q4":
        return dequant_q4(qweight, scales, mins, dtype)
    if fmt == "q8":
        return dequant_q8(qweight, scales, dtype)
    raise ValueError(f"unknown weight layout {fmt!r} (q4 or q8)")


def wq_matmul_ref(x: torch.Tensor, fmt: str, qweight: torch.Tensor, scales: torch.Tensor,
                  mins: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ W^T`` -> ``[M, N]`` float32, W dequantized in float32 (the reference)."""
    return x.float() @ dequant(fmt, qweight, scales, mins).t()
