"""Triton kernel that writes the new tokens' K/V into the paged KV pool.

Semantics: :func:`kernels.reference.store_kv_ref` (``k_buffer[loc[i]] = k[i]``, cast to the
pool dtype). One program copies one token's K and V rows (all KV heads at once, a
``[BLOCK_H, BLOCK_D]`` tile), so the copy is a coalesced read of each head's contiguous
``head_dim`` values and a coalesced write into the slot. The source tensors may be strided
views (e.g. k/v sliced out of a fused qkv projection); only ``head_dim`` must be the
innermost, unit-stride axis of every tensor.

Runs unchanged on CUDA and XPU (no vendor-specific intrinsics) and in the Triton
interpreter (``TRITON_INTERPRET=1``) on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_buf, v_buf, loc_ptr, k_ptr, v_ptr,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_kt, stride_kh, stride_vt, stride_vh, k_inv, v_inv,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)

    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    if KV_FP8:
        # quantised in registers, as kernels.extend_attention.fp8_kv_as_stored rounds it
        k = k.to(tl.float32) * k_inv
    tl.store(k_buf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :],
             k.to(k_buf.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    if KV_FP8:
        v = v.to(tl.float32) * v_inv
    tl.store(v_buf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :],
             v.to(v_buf.dtype.element_ty), mask=mask)


def _check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() != 3 or t.stride(2) != 1:
        raise ValueError(f"{name} must be 3-D with a unit-stride last (head_dim) axis, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """Write new K/V rows into pool slots: ``k_buffer[loc[i]] = k[i]`` (Triton).

    Args:
        k_buffer, v_buffer: ``[S, Hkv, D]`` pool tensors of one layer (any float dtype),
            written in place.
        loc: ``[T]`` int64 (or int32) slot of each new token. Slots must be distinct
            (duplicates race, as in the reference where the last write wins).
        k, v: ``[T, Hkv, D]`` new keys/values, any float dtype (cast to the pool dtype);
            may be strided views as long as the last axis has unit stride.
        k_scale, v_scale: per-tensor scales of an FP8 pool (float8_e4m3fn/e5m2): it
            stores ``k / k_scale`` rounded to FP8 (nearest even, saturating on CUDA/XPU),
            K and V in the same program, quantised in registers; ignored for a wider pool.

    Raises:
        ValueError: mismatched shapes, a non-unit-stride last axis, or an FP8 pool with a
            non-positive scale.

    One program per token; no host synchronisation (graph capturable).
    """
    t = loc.shape[0]
    if k.shape != v.shape or k.shape[0] != t or k.shape[1:] != k_buffer.shape[1:] \
            or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"store_kv shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"loc {tuple(loc.shape)}, pool {tuple(k_buffer.shape)}")
    for name, x in (("k", k), ("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        _check_inner_contiguous(name, x)
    fp8 = k_buffer.element_size() == 1
    if fp8 and (k_scale <= 0 or v_scale <= 0):
        raise ValueError(f"FP8 KV scales must be positive, got {k_scale}, {v_scale}")
    if t == 0:
        return
    hkv, d = k.shape[1], k.shape[2]
    block_h = triton.next_power_of_2(hkv)
    block_d = triton.next_power_of_2(d)
    # 1 warp moves 32 lanes x 4..8 elements; bigger rows get more warps.
    num_warps = 1 if block_h * block_d <= 512 else (2 if block_h * block_d <= 2048 else 4)
    _store_kv_kernel[(t,)](
        k_buffer, v_buffer, loc, k, v,
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), 1.0 / k_scale, 1.0 / v_scale,
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, KV_FP8=fp8,
        num_warps=num_warps,
    )
