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
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, stride_q, stride_k, stride_c,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   HALF: tl.constexpr, BLOCK: tl.constexpr):
    # one program per token: all of its q and k heads as two [heads, D/2] tiles
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK)
    mask_d = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_d, mask=mask_d, other=0.0)
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
    t = q.shape[0]
    if t == 0:
        return q, k
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_inplace needs a contiguous last dimension")
    half = head_dim // 2
    hq = q.shape[-1] // head_dim
    hk = k.shape[-1] // head_dim
    block_hq = triton.next_power_of_2(hq)
    block = triton.next_power_of_2(half)
    _rotary_kernel[(t,)](
        q, k, positions, cos_sin_cache, q.stride(0), k.stride(0), cos_sin_cache.stride(0),
        NUM_Q_HEADS=hq, NUM_K_HEADS=hk, BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(hk), HALF=half, BLOCK=block,
        num_warps=4 if block_hq * block >= 2048 else 1)
    return q, k
