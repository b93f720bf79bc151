"""The gated delta rule's decode step in Triton, updating the state pool in place.

One token for each of B requests, each reading and writing its own slot of the recurrent-state
pool (``engine/kv/state_pool.py``): fla-core 0.6's fused recurrent kernel takes the states as
a dense ``[B, Hv, K, V]`` tensor, so the layer would gather the B slots out of the pool and
scatter them back, three times the state traffic of the step (2 MiB per request and layer at
Qwen3-Next's 32 value heads of 128 x 128: at 64 requests and 36 layers, 14 GB instead of
5 GB per decode step). This kernel indexes the pool by slot instead.

Semantics: :func:`kernels.linear_attention.reference.recurrent_gated_delta_rule_update_ref`.
One program per (block of BV value columns, request, value head); it keeps the [K, BV] tile
of the state in registers: ``S <- exp(g) S;  S <- S + k (beta (v - k^T S));  o = q^T S``
with q and k L2-normed (optional) and q scaled by ``K ** -0.5``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, o_ptr,
                       scale, eps, dst_base, stride_qb, stride_kb, stride_vb,
                       HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                       N: tl.constexpr, VERIFY: tl.constexpr):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    req = i_bh // HV
    h = i_bh % HV
    hk = h // (HV // HK)
    slot = tl.load(slot_ptr + req * N).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    m = mk[:, None] & mv[None, :]
    tile = (h * K + offs_k[:, None]) * V + offs_v[None, :]
    s = tl.load(state_ptr + slot * HV * K * V + tile, mask=m, other=0.0)
    for t in tl.static_range(N):
        b = req * N + t
        q = tl.load(q_ptr + b * stride_qb + hk * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * stride_kb + hk * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        q = q * scale
        v = tl.load(v_ptr + b * stride_vb + h * V + offs_v, mask=mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * HV + h).to(tl.float32)
        beta = tl.load(beta_ptr + b * HV + h).to(tl.float32)
        s = s * tl.exp(g)
        kv = tl.sum(s * k[:, None], axis=0)
        delta = (v - kv) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + (b * HV + h) * V + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)
        if VERIFY:  # the state after each token, in its own scratch slot
            tl.store(state_ptr + (dst_base + b).to(tl.int64) * HV * K * V + tile, s, mask=m)
    if not VERIFY:
        tl.store(state_ptr + slot * HV * K * V + tile, s, mask=m)


def _heads_packed(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, D] as the kernel reads it: any row stride, heads and dims packed (the
    column slices of the conv output are read in place; other layouts are copied)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def recurrent_gated_delta_rule_update_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, use_qk_l2norm: bool = True,
    verify_n: int = 0, dst_base: int = 0,
) -> torch.Tensor:
    """One decode step of B requests over the state pool, in place.

    With ``verify_n`` = n > 0 (a speculative verify step) the B rows are B / n requests of n
    consecutive tokens: request r runs its n tokens from ``states[slots[r * n]]``, which it
    leaves as it is, and writes the state after its token t to slot ``dst_base + r * n + t``
    (the pool's scratch slots).

    Args: ``q``, ``k`` [B, Hk, K]; ``v`` [B, Hv, V] (rows may be strided, as the column
    slices of the conv output are: read in place); ``g``, ``beta`` [B, Hv]; ``states``
    [S, Hv, K, V] float32 (the pool's tensor, updated in place at ``slots``; in verify mode
    only the scratch slots are written); ``slots`` [B] int (distinct; in verify mode one per
    row, of which each request's first is read).
    Returns: ``o`` [B, Hv, V] in q's dtype.
    Raises: ValueError when Hv % Hk != 0, the states are not float32 or B is not a
    multiple of ``verify_n``.
    """
    b, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads {hv} are not a multiple of key heads {hk}")
    if states.dtype != torch.float32:
        raise ValueError(f"the recurrent states are float32, not {states.dtype}")
    n = verify_n or 1
    if b % n:
        raise ValueError(f"{b} rows are not requests of {n} tokens")
    o = torch.empty(b, hv, dv, dtype=q.dtype, device=q.device)
    if b == 0:
        return o
    bv = min(32, triton.next_power_of_2(dv))
    grid = (triton.cdiv(dv, bv), b // n * hv)
    q, k, v = _heads_packed(q), _heads_packed(k), _heads_packed(v)
    _gdn_decode_kernel[grid](
        q, k, v, g.contiguous(), beta.contiguous(),
        states, slots.contiguous(), o, dk ** -0.5, 1e-6, dst_base, q.stride(0), k.stride(0),
        v.stride(0), HK=hk, HV=hv, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=bv,
        L2NORM=use_qk_l2norm, N=n, VERIFY=verify_n > 0)
    return o
