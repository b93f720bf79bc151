"""Fused element-wise ops in Triton; their torch references live in :mod:`kernels.reference`.

* :func:`rms_norm` -- RMSNorm (Zhang & Sennrich, 2019) with an optional fused residual add,
  matching HF Llama's ``LlamaRMSNorm`` numerics: the sum ``x + residual`` is rounded to the
  activation dtype (it becomes the next residual), the statistics run in fp32, the
  normalised value is rounded to the activation dtype and then scaled by the weight.
  One program per row; the whole row lives in registers (hidden sizes up to 16k).
* :func:`gated_rms_norm` -- Qwen3-Next's gated RMSNorm ``weight * rmsnorm(x) * silu(gate)``
  over ``[T * Hv, V]`` head rows, with the eager reference's rounding order (normed value
  cast to x's dtype, times the weight, times ``silu(gate)`` in fp32, one cast). A program
  holds up to 16 rows (~2k values), so a decode step's few rows take one or two programs.
* :func:`silu_and_mul` -- SwiGLU's ``silu(gate) * up`` over a merged ``[.., 2 * I]``
  gate/up projection (Shazeer, "GLU Variants Improve Transformer", 2020), computed in fp32
  and rounded once. Grid ``(rows, cdiv(I, BLOCK))``.

Each saves a round trip through memory per op compared with eager torch (which writes the
sum, the fp32 upcast, the normalised value, ... as separate tensors). They run unchanged on
CUDA, XPU and in the Triton interpreter, with one launch table: none has a ``tl.dot``, so
triton-xpu runs their warps as 32-lane sub-groups, as wide as CUDA's warps, and the same
``num_warps`` gives the same threads per row (``kernels/launch.py`` has the rule for
``tl.dot`` kernels, whose XPU entries differ). Their semantics are defined by the one eager
version of each op in :mod:`kernels.reference` (``rms_norm_ref``, ``gemma_rms_norm_ref``,
``gated_rms_norm_ref``, ``silu_and_mul_ref``),
which the CPU path runs; ``engine.layers.select_ops`` picks one or the other per model.
All are out-of-place, like the references: they return new tensors and never write their
inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------- kernels


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     ZERO_CENTRED: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        s = (xf + r.to(tl.float32)).to(dtype)          # rounded like an eager add
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        xf = s.to(tl.float32)
    var = tl.sum(xf * xf, 0) / HIDDEN
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if ZERO_CENTRED:  # Gemma: (1 + w) applied in fp32, one rounding at the store
        out = xf * tl.rsqrt(var + eps) * (1.0 + w.to(tl.float32))
    else:
        y = (xf * tl.rsqrt(var + eps)).to(dtype)
        out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, eps, n_rows, heads,
                           stride_xt, stride_xh, stride_gt, stride_gh,
                           HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                           ROUND_PRODUCT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)   # row = t * heads + h
    t = rows // heads
    h = rows % heads
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HIDDEN)
    x_off = (t * stride_xt + h * stride_xh)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 1) / HIDDEN
    y = (xf * tl.rsqrt(var + eps)[:, None]).to(dtype)           # normed, in x's dtype
    w = tl.load(w_ptr + cols, mask=cols < HIDDEN, other=0.0)
    wy = w.to(tl.float32)[None, :] * y.to(tl.float32)
    if ROUND_PRODUCT:   # weight * normed rounded like the eager product (same dtypes)
        wy = wy.to(dtype).to(tl.float32)
    g_off = (t * stride_gt + h * stride_gh)[:, None] + cols[None, :]
    g = tl.load(g_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    out = wy * (g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o,
                         INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

# ---------------------------------------------------------------------------- wrappers


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """View x [..., H] as [N, H] without copying (rows may be strided; H must be unit)."""
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit-stride last axis")
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, zero_centred: bool = False):
    """Fused RMSNorm (+ residual add) in Triton; semantics of
    :func:`kernels.reference.rms_norm_ref` (or, with ``zero_centred``, of
    :func:`kernels.reference.gemma_rms_norm_ref`); out-of-place.

    Args:
        x: ``[..., H]`` activations (fp16/bf16/fp32), last axis unit stride.
        weight: ``[H]`` scale.
        eps: added to the mean square (e.g. 1e-5).
        residual: optional tensor shaped like ``x``; then ``x + residual`` is normalised.

    Returns:
        ``out`` (new tensor, x's shape and dtype), or ``(out, x + residual)``.

    Raises:
        ValueError: shape mismatches, a non-unit-stride last axis, or H > 65536.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm shape mismatch: x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    if hidden > 65536:
        raise ValueError("rms_norm keeps a row in registers: hidden size must be <= 65536")
    x2 = _rows(x, "x")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual, "residual")
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = res_out.view(-1, hidden)
    else:
        r2, ro2, res_out = x2, out2, None
    n = x2.shape[0]
    if n:
        block = triton.next_power_of_2(hidden)
        num_warps = min(max(block // 512, 1), 16)    # ~16 fp32 values per thread
        _rms_norm_kernel[(n,)](
            x2, r2, weight, out2, ro2, eps,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            ZERO_CENTRED=zero_centred, num_warps=num_warps,
        )
    return out if residual is None else (out, res_out)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """Gemma's RMSNorm (zero-centred weight, ``(1 + w)`` applied in fp32 before the one cast;
    :func:`kernels.reference.gemma_rms_norm_ref`) by :func:`rms_norm`'s kernel; arguments,
    returns and errors as :func:`rms_norm`."""
    return rms_norm(x, weight, eps, residual, zero_centred=True)


def _head_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """View x [..., V] as [T, H, V] (any strides on T and H; V must be unit stride): a 1- or
    2-axis tensor gets unit axes, more than three leading axes are merged by ``reshape``
    (which copies only where they do not merge)."""
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit-stride last axis")
    if x.dim() < 3:
        return x.reshape(1, 1, -1) if x.dim() == 1 else x.unsqueeze(1)
    return x if x.dim() == 3 else x.reshape(-1, *x.shape[-2:])


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Qwen3-Next's gated RMSNorm, ``weight * rmsnorm(x) * silu(gate)`` per row, in one
    Triton launch; semantics (and rounding order) of
    :func:`kernels.reference.gated_rms_norm_ref`; out-of-place.

    Args:
        x: ``[..., V]`` values (fp16/bf16/fp32), e.g. ``[T, Hv, V]``. The last axis must have
            unit stride; the rows are read in place whatever the strides of a ``[N, V]`` or
            ``[T, Hv, V]`` view (more leading axes are merged by ``reshape``, a copy where
            they do not merge).
        gate: shaped like ``x``, any float dtype, the same stride rule (its own strides).
        weight: ``[V]`` scale.
        eps: added to the mean square (e.g. 1e-6).

    Returns:
        New contiguous ``[..., V]`` tensor in x's dtype.

    Raises:
        ValueError: shape mismatches, a non-unit-stride last axis (refused rather than
            copied, like :func:`rms_norm`), or V > 65536.
    """
    hidden = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (hidden,):
        raise ValueError(f"gated_rms_norm shape mismatch: x {tuple(x.shape)}, gate "
                         f"{tuple(gate.shape)}, weight {tuple(weight.shape)}")
    if hidden > 65536:
        raise ValueError("gated_rms_norm keeps a row in registers: V must be <= 65536")
    x3, g3 = _head_rows(x, "x"), _head_rows(gate, "gate")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x3.shape[0] * x3.shape[1]
    if n and hidden:
        block = triton.next_power_of_2(hidden)
        rows = max(1, min(16, 2048 // block))       # ~2k values per program
        num_warps = min(max(rows * block // 512, 1), 16)
        _gated_rms_norm_kernel[(triton.cdiv(n, rows),)](
            x3, g3, weight, out, eps, n, x3.shape[1],
            x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1),
            HIDDEN=hidden, BLOCK=block, ROWS=rows,
            ROUND_PRODUCT=torch.promote_types(weight.dtype, x.dtype) == x.dtype,
            num_warps=num_warps,
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Fused ``silu(gate) * up`` in Triton; semantics of
    :func:`kernels.reference.silu_and_mul_ref`; out-of-place.

    Args:
        x: ``[..., 2 * I]`` merged gate/up projection (gate first), last axis unit stride.

    Returns:
        New ``[..., I]`` tensor in x's dtype.

    Raises:
        ValueError: an odd last axis or a non-unit-stride last axis.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last axis, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = _rows(x, "x")
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    n = x2.shape[0]
    if n and inter:
        block = min(triton.next_power_of_2(inter), 1024)
        _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](
            x2, out2, x2.stride(0), out2.stride(0), INTER=inter, BLOCK=block,
            num_warps=4 if block >= 512 else 1,
        )
    return out


__all__ = ["gated_rms_norm", "gemma_rms_norm", "rms_norm", "silu_and_mul"]
