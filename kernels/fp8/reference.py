"""The torch references of the FP8 kernels (:mod:`kernels.fp8.fp8_triton`,
:mod:`kernels.fp8.block_triton`): per-row e4m3 quantization and the two FP8 matmuls with
upcast operands; block-wise FP8 (per-block weight scales, per-token-group activation
scales) below. The CPU runs them, the GPUs where
a Triton kernel or ``torch._scaled_mm`` is missing, and the tests compare the kernels with them.
No Triton import.
"""

from __future__ import annotations

import torch

from kernels.fp8.constants import FP8_DTYPE, FP8_MAX, SCALE_EPS


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric e4m3 quantization, one scale per row (the torch reference).

    Args:
        x: [M, K], any float dtype.
    Returns:
        ``(xq [M, K] float8_e4m3fn, scale [M, 1] float32)`` with
        ``scale = max(amax_k |x|, 1e-12) / 448`` and ``xq = fp8(clamp(x / scale, ±448))``,
        so ``xq * scale`` approximates ``x``.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_EPS) / FP8_MAX
    xq = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


def fp8_matmul_dequant(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor,
                       sw: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """``(xq @ wq^T) * sx * sw^T`` with the e4m3 operands upcast to ``compute_dtype``.

    Args:
        xq: [M, K] e4m3; sx: [M, 1] fp32; wq: [N, K] e4m3; sw: [N] fp32.
    Returns:
        [M, N] float32.
    """
    acc = torch.matmul(xq.to(compute_dtype), wq.to(compute_dtype).t())
    return acc.float() * sx * sw


def fp8_matmul_weight_only(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                           compute_dtype: torch.dtype) -> torch.Tensor:
    """``(x @ wq^T) * sw^T`` with the e4m3 weights upcast to ``compute_dtype``.

    Args:
        x: [M, K] float; wq: [N, K] e4m3 (or its exact upcast); sw: [N] fp32.
    Returns:
        [M, N] float32.
    """
    acc = torch.matmul(x.to(compute_dtype), wq.to(compute_dtype).t())
    return acc.float() * sw


# ---- block-wise FP8 ---------------------------------------------------------------------
#
# DeepSeek-V3's checkpoint format: weights quantized per ``[bn, bk]`` block
# (``weight_block_size``, [128, 128] in every published checkpoint), activations quantized
# per token per group of ``bk`` columns (:mod:`kernels.fp8.block_triton` on GPUs).
#
# Numerics (``q(v, s)`` rounds ``clamp(v / s, ±448)`` to float8_e4m3fn, nearest even):
#
# - weight ``W [N, K]`` -> ``Wq [N, K]`` e4m3 and ``S [ceil(N/bn), ceil(K/bk)]`` fp32 with
#   ``S_ij = max(amax |W_block ij|, 1e-12) / 448``; the dequantized weight is ``Wq * S`` per
#   block (a checkpoint's ``weight_scale_inv`` is this ``S``; the last row and column of
#   blocks may be partial);
# - activation ``x [M, K]`` -> ``xq [M, K]`` e4m3 and ``sx [M, ceil(K/bk)]`` fp32, the same
#   formula per token per group of ``bk`` columns;
# - ``y = sum_j (xq_j @ Wq_j^T) * sx_j * S_j^T`` over the groups ``j`` of K (W8A8), or
#   ``y = x @ (Wq * S)^T`` (weight-only).
#
# A layer may keep its scales one row per weight row (``row_div = 1``: a fused layer whose
# parts do not start on a block boundary) instead of one per block of rows
# (``row_div = bn``): scale row ``n // row_div`` belongs to weight row ``n``.

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_weight_blocks(w: torch.Tensor, block: tuple[int, int]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [N, K]`` (any float dtype) per ``block = (bn, bk)``.

    Returns:
        ``(wq [N, K] float8_e4m3fn, scale [ceil(N/bn), ceil(K/bk)] float32)``.
    """
    bn, bk = block
    n, k = w.shape
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    wf = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    wf[:n, :k] = w.float()
    blocks = wf.view(nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=SCALE_EPS) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def expand_scale_rows(scale: torch.Tensor, rows: int, row_div: int) -> torch.Tensor:
    """Scales ``[R, Kb]`` (one row per ``row_div`` weight rows) -> ``[rows, Kb]``, one per
    weight row."""
    if row_div == 1:
        return scale[:rows]
    return scale.repeat_interleave(row_div, dim=0)[:rows]


def dequantize_weight_blocks(wq: torch.Tensor, scale: torch.Tensor, block_k: int,
                             row_div: int) -> torch.Tensor:
    """``Wq * S`` per block: ``wq [N, K]`` e4m3 (or its exact upcast), ``scale [R, Kb]`` fp32
    (``row_div`` weight rows per scale row) -> ``[N, K]`` float32."""
    n, k = wq.shape
    s = expand_scale_rows(scale.float(), n, row_div)
    return wq.float() * s.repeat_interleave(block_k, dim=1)[:, :k]


def quantize_act_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-group e4m3 quantization of activations.

    Args:
        x: [M, K], any float dtype.
        group: columns per scale (the weights' ``bk``).
    Returns:
        ``(xq [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32)``.
    """
    m, k = x.shape
    kb = _cdiv(k, group)
    xf = torch.zeros(m, kb * group, dtype=torch.float32, device=x.device)
    xf[:, :k] = x.float()
    g = xf.view(m, kb, group)
    scale = g.abs().amax(dim=-1).clamp(min=SCALE_EPS) / FP8_MAX
    q = (g / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, kb * group)[:, :k].contiguous(), scale


def fp8_block_linear_reference(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                               block_k: int, row_div: int, quant_x: bool,
                               w_dequant: torch.Tensor | None = None,
                               compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x [M, K] @ W^T`` with block-FP8 ``W`` by dequantizing: weight-only
    (``quant_x=False``) or W8A8 (x quantized per token per ``block_k`` columns first).

    Args:
        x: [M, K] float.
        wq: [N, K] float8_e4m3fn; scale: [R, ceil(K/block_k)] fp32, ``row_div`` rows each.
        w_dequant: the precomputed ``dequantize_weight_blocks(wq, scale, ...)`` [N, K]
            (the CPU layers keep it), or None to compute it.
        compute_dtype: the matmul's dtype (fp32 on the CPU).
    Returns:
        [M, N] float32.
    """
    w = w_dequant if w_dequant is not None else dequantize_weight_blocks(wq, scale, block_k,
                                                                         row_div)
    if quant_x:
        xq, sx = quantize_act_groups(x, block_k)
        x = xq.float() * sx.repeat_interleave(block_k, dim=1)[:, :x.shape[1]]
    return torch.matmul(x.to(compute_dtype), w.to(compute_dtype).t()).float()
