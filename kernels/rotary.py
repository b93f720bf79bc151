"""Fused rotary position embedding (RoPE, Su et al. 2021) for q and k in one launch.

Rotate-half ("NeoX") layout as in HF Llama/Qwen: for each head, with ``x1 = x[:D/2]`` and
``x2 = x[D/2:]``, ``out = [x1*cos - x2*sin, x2*cos + x1*sin]``. The rotation runs in fp32 and
is rounded once to the activation dtype. Eager torch needs about ten launches (index the
cos/sin table, upcast, chunk, four products, concatenation, downcast) per tensor; this is one
for both.

The semantics are those of :func:`kernels.reference.rotary_ref`, the one eager version (the
CPU path), except that this kernel writes q and k in place while the reference returns new
tensors; callers use the returned pair either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_tile(base, stride_h, n_heads, cos, sin, offs_d, mask_d,
                 BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < n_heads) & mask_d[None, :]
    p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    tl.store(p1, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(p1 + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _token_cos_sin(pos_ptr, cache_ptr, stride_c, HALF: tl.constexpr, BLOCK: tl.constexpr):
    # this program's token, its position's cos and sin rows [BLOCK] (masked past D/2)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK)
    mask_d = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_d, mask=mask_d, other=0.0)
    return t, cos, sin, offs_d, mask_d


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, stride_q, stride_k, stride_c,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   HALF: tl.constexpr, BLOCK: tl.constexpr):
    # one program per token: all of its q and k heads as two [heads, D/2] tiles
    t, cos, sin, offs_d, mask_d = _token_cos_sin(pos_ptr, cache_ptr, stride_c, HALF, BLOCK)
    _rotate_tile(q_ptr + t * stride_q, 2 * HALF, NUM_Q_HEADS, cos, sin, offs_d, mask_d,
                 BLOCK_HQ, HALF)
    _rotate_tile(k_ptr + t * stride_k, 2 * HALF, NUM_K_HEADS, cos, sin, offs_d, mask_d,
                 BLOCK_HK, HALF)


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq*D] and k [T, Hkv*D] in place (they may be views of a fused qkv
    output: only the last dimension must be contiguous). positions [T] int64;
    cos_sin_cache [P, D] fp32 with cos in the first half. Returns the same (q, k) objects,
    now rotated (:func:`kernels.reference.rotary_ref` returns new ones instead).

    Raises:
        ValueError: q or k without a contiguous last dimension.

    One program per token handles all its heads (a first version with one program per
    (token, head) ran prefill rotary at a fifth of the memory bandwidth on an H200).
    """
    if q.shape[0] == 0:
        return q, k
    _rotary_kernel[(q.shape[0],)](
        q, k, positions, cos_sin_cache, q.stride(0), k.stride(0), cos_sin_cache.stride(0),
        **_token_launch(q, k, head_dim, "rotary_inplace"))
    return q, k


def _token_launch(q: torch.Tensor, k: torch.Tensor, head_dim: int, name: str) -> dict:
    """The constexprs and warps of the one-program-per-token kernels here (all of a token's
    q and k heads as two ``[heads, D/2]`` tiles). Raises: ValueError naming ``name`` for a
    q or k without a contiguous last dimension."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")
    half = head_dim // 2
    hq, hk = q.shape[-1] // head_dim, k.shape[-1] // head_dim
    block_hq, block = triton.next_power_of_2(hq), triton.next_power_of_2(half)
    return dict(NUM_Q_HEADS=hq, NUM_K_HEADS=hk, BLOCK_HQ=block_hq,
                BLOCK_HK=triton.next_power_of_2(hk), HALF=half, BLOCK=block,
                num_warps=4 if block_hq * block >= 2048 else 1)


@triton.jit
def _norm_rotate_tile(base, stride_h, n_heads, w_ptr, eps, cos, sin, offs_d, mask_d,
                      BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                      ZERO_CENTRED: tl.constexpr):
    # the per-head RMSNorm of kernels.fused_ops._rms_norm_kernel (its roundings), then the
    # rotation of _rotate_tile on the normed values, in place
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < n_heads) & mask_d[None, :]
    p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if ZERO_CENTRED:  # Gemma: (1 + w) in fp32, rounded once
        y1 = (x1 * rstd * (1.0 + w1)).to(dtype).to(tl.float32)
        y2 = (x2 * rstd * (1.0 + w2)).to(dtype).to(tl.float32)
    else:             # HF Llama: normed, rounded, times the weight, rounded
        y1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        y2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(p1, (y1 * cos[None, :] - y2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(p1 + HALF, (y2 * cos[None, :] + y1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rotary_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, eps, pos_ptr, cache_ptr, stride_q,
                           stride_k, stride_c, NUM_Q_HEADS: tl.constexpr,
                           NUM_K_HEADS: tl.constexpr, BLOCK_HQ: tl.constexpr,
                           BLOCK_HK: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                           ZERO_CENTRED: tl.constexpr):
    t, cos, sin, offs_d, mask_d = _token_cos_sin(pos_ptr, cache_ptr, stride_c, HALF, BLOCK)
    _norm_rotate_tile(q_ptr + t * stride_q, 2 * HALF, NUM_Q_HEADS, qw_ptr, eps, cos, sin,
                      offs_d, mask_d, BLOCK_HQ, HALF, ZERO_CENTRED)
    _norm_rotate_tile(k_ptr + t * stride_k, 2 * HALF, NUM_K_HEADS, kw_ptr, eps, cos, sin,
                      offs_d, mask_d, BLOCK_HK, HALF, ZERO_CENTRED)


def qk_norm_rotary_inplace(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, head_dim: int,
                           zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3's ``q_norm``/``k_norm``; Gemma's ``(1 + w)`` form
    with ``zero_centred``) and the rotary of :func:`rotary_inplace`, in one launch, in place:
    the two norms' launches and their output tensors go. The roundings are those of the
    unfused ops in sequence (:func:`kernels.reference.rms_norm_ref` or
    :func:`kernels.reference.gemma_rms_norm_ref` over each head, then
    :func:`kernels.reference.rotary_ref`), so either path gives the same values.

    Args:
        q: ``[T, Hq*D]``, k: ``[T, Hkv*D]`` (fp16/bf16/fp32; views of a fused qkv output
            allowed: only the last dimension must be contiguous); written in place.
        q_weight, k_weight: ``[D]`` norm weights.  eps: added to the mean square.
        positions: ``[T]`` int64.  cos_sin_cache: ``[P, D]`` fp32, cos in the first half.
        head_dim: D (the whole head rotates: no partial or interleaved rotary).
    Returns:
        the same ``(q, k)`` objects.
    Raises:
        ValueError: a non-contiguous last dimension or weights not ``[D]``.
    """
    launch = _token_launch(q, k, head_dim, "qk_norm_rotary_inplace")
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(f"q/k norm weights must be [{head_dim}], got "
                         f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    if q.shape[0]:
        _qk_norm_rotary_kernel[(q.shape[0],)](
            q, k, q_weight, k_weight, eps, positions, cos_sin_cache, q.stride(0), k.stride(0),
            cos_sin_cache.stride(0), ZERO_CENTRED=zero_centred, **launch)
    return q, k
