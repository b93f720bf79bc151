"""MLA prefill/extend in Triton, in the MHA form: the K/V of each request's whole sequence
(cached prefix + new tokens) decompressed through ``kv_b_proj``, then causal attention with
a query/key head of ``N + P`` (nope + rope) and a value head of ``V``.

Why the MHA form for extend (and the absorbed form only for decode, as SGLang and vLLM do):
a prefill's cost is its ``T x S`` score and value products. Per (query, key, head) the MHA
form spends ``N + P + V`` multiply-adds (128 + 64 + 128 = 320 for DeepSeek-V3), the absorbed
form ``2R + P`` (1088), 3.4x more; the MHA form's extra work is the decompression of the
``S`` latent rows (``S x H x (N + V) x R``, one GEMM by cuBLAS), which is linear in ``S``
and so cheap next to the quadratic attention of a long prompt; and its tiles are an
ordinary flash-attention's (64 query rows x 64 keys with heads of 128/64), where the
absorbed form's ``[BLOCK_M, 512]`` fp32 accumulator forces small query blocks. Decode is
the other way round: one query row, so the attention is a read of the latent cache, which
the absorbed form reads once for all heads (``kernels/mla/decode.py``).

Layout: the step's extending requests' K/V are contiguous and ragged: request ``b`` owns
rows ``kv_start[b] .. kv_start[b] + seq_lens[b]`` of ``k_nope [S, H, N]``, ``v [S, H, V]``
and ``k_pe [S, P]`` (the rope key is shared by the heads: never broadcast); its new tokens
are rows ``q_start[b] ..`` of ``q_nope [T, H, N]``, ``q_pe [T, H, P]`` and ``o [T, H, V]``,
the last ``ext_lens[b]`` positions of its sequence. :func:`ragged_latent_slots` builds the
pool slots of those K/V rows on the device (no host sync, no loop over requests).

Algorithm: FlashAttention-2 tiling (Dao 2023), grid ``(B, H, cdiv(max_ext, BLOCK_M))``,
query blocks heaviest first (as ``kernels/extend_attention.py``): keys before the block's
first query position, unmasked, then the diagonal tiles with the causal mask. The score is
two dots, ``q_nope . k_nope + q_pe . k_pe`` (no padding of 192 up to 256). Launch: 64 x 64
tiles and 8 warps for 16-bit dtypes, 16 x 16 and 4 warps for fp32 (ieee dots);
XPU doubles the warps (:mod:`kernels.launch`). Not tuned on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import dot_kernel_options

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_tile(q_nope, q_pe, k_rows, kpe_rows, v_rows, mask_n, offs_nd, mask_nd, offs_pd,
              mask_pd, offs_vd, mask_vd, m_i, l_i, acc, qk_scale, visible,
              DOT_PREC: tl.constexpr):
    """One key tile: scores of the nope and rope parts, masked by ``visible``, folded into
    the online softmax ``(m_i, l_i, acc)``."""
    dt = q_nope.dtype
    k = tl.load(k_rows[:, None] + offs_nd[None, :], mask=mask_n[:, None] & mask_nd[None, :],
                other=0.0).to(dt)
    kp = tl.load(kpe_rows[:, None] + offs_pd[None, :], mask=mask_n[:, None] & mask_pd[None, :],
                 other=0.0).to(dt)
    qk = tl.dot(q_nope, tl.trans(k), input_precision=DOT_PREC)
    qk += tl.dot(q_pe, tl.trans(kp), input_precision=DOT_PREC)
    qk = tl.where(visible, qk * qk_scale, float("-inf"))
    v = tl.load(v_rows[:, None] + offs_vd[None, :], mask=mask_n[:, None] & mask_vd[None, :],
                other=0.0).to(dt)
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _mla_prefill_kernel(
    q_nope_ptr, q_pe_ptr, k_nope_ptr, k_pe_ptr, v_ptr, o_ptr,
    seq_lens, ext_lens, q_start_loc, kv_start_loc, qk_scale,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt,
    stride_vt, stride_vh, stride_ot, stride_oh,
    NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_ND: tl.constexpr,
    BLOCK_PD: tl.constexpr, BLOCK_VD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.num_programs(2) - 1 - tl.program_id(2)   # heaviest query blocks first
    ext_len = tl.load(ext_lens + b)
    m_lo = mblk * BLOCK_M
    if m_lo < ext_len:
        seq_len = tl.load(seq_lens + b)
        prefix = seq_len - ext_len
        qs = tl.load(q_start_loc + b).to(tl.int64)
        ks = tl.load(kv_start_loc + b).to(tl.int64)
        offs_m = m_lo + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext_len
        offs_nd = tl.arange(0, BLOCK_ND)
        mask_nd = offs_nd < NOPE
        offs_pd = tl.arange(0, BLOCK_PD)
        mask_pd = offs_pd < ROPE
        offs_vd = tl.arange(0, BLOCK_VD)
        mask_vd = offs_vd < VDIM
        rows_q = qs + offs_m
        q_nope = tl.load(q_nope_ptr + rows_q[:, None] * stride_qnt + h * stride_qnh
                         + offs_nd[None, :], mask=mask_m[:, None] & mask_nd[None, :], other=0.0)
        q_pe = tl.load(q_pe_ptr + rows_q[:, None] * stride_qpt + h * stride_qph
                       + offs_pd[None, :], mask=mask_m[:, None] & mask_pd[None, :],
                       other=0.0).to(q_nope.dtype)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_VD], dtype=tl.float32)
        q_pos = prefix + offs_m

        # keys before the block's first query: visible to every row, no mask
        full = (prefix + m_lo) // BLOCK_N * BLOCK_N
        for n0 in range(0, full, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            kv = ks + offs_n
            all_n = offs_n >= 0
            m_i, l_i, acc = _mla_tile(
                q_nope, q_pe, k_nope_ptr + kv * stride_knt + h * stride_knh,
                k_pe_ptr + kv * stride_kpt, v_ptr + kv * stride_vt + h * stride_vh, all_n,
                offs_nd, mask_nd, offs_pd, mask_pd, offs_vd, mask_vd, m_i, l_i, acc, qk_scale,
                all_n[None, :], DOT_PREC)
        # the rest up to the block's last query: causal and length masked
        hi = tl.minimum(seq_len, prefix + m_lo + BLOCK_M)
        for n0 in range(full, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            kv = ks + offs_n
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            m_i, l_i, acc = _mla_tile(
                q_nope, q_pe, k_nope_ptr + kv * stride_knt + h * stride_knh,
                k_pe_ptr + kv * stride_kpt, v_ptr + kv * stride_vt + h * stride_vh, mask_n,
                offs_nd, mask_nd, offs_pd, mask_pd, offs_vd, mask_vd, m_i, l_i, acc, qk_scale,
                visible, DOT_PREC)
        # every row sees key 0, so l_i > 0
        out = acc / l_i[:, None]
        tl.store(o_ptr + rows_q[:, None] * stride_ot + h * stride_oh + offs_vd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_vd[None, :])


def ragged_latent_slots(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                        seq_lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool slots of the requests' whole sequences, request after request, and where
    each request starts in them: ``(slots [total] int64, kv_start [B] int32)``.

    Args:
        req_to_token: ``[rows, max_context]`` int32 slot table.
        req_pool_indices: ``[B]`` int rows; seq_lens: ``[B]`` int lengths (device).
        total: the host int ``sum(seq_lens)`` (sizes the result; no device sync).
    """
    dev = seq_lens.device
    lens = seq_lens.long()
    starts = torch.cumsum(lens, 0) - lens
    req = torch.repeat_interleave(torch.arange(lens.shape[0], device=dev), lens,
                                  output_size=total)
    pos = torch.arange(total, device=dev) - starts[req]
    slots = req_to_token[req_pool_indices.long()[req], pos].long()
    return slots, starts.to(torch.int32)


def _prefill_meta(nope: int, rope: int, vdim: int, dtype: torch.dtype, device_type: str,
                  block_m: int | None, block_n: int | None,
                  num_warps: int | None) -> tuple[dict, dict]:
    fp32 = dtype == torch.float32
    block_m = block_m or (16 if fp32 else 64)
    block_n = block_n or (16 if fp32 else 64)
    for blk in (block_m, block_n):
        if blk < 16 or blk & (blk - 1):
            raise ValueError("block_m and block_n must be powers of two >= 16")
    opts = dot_kernel_options(4 if fp32 else 8, 2, device_type)
    if num_warps:
        opts["num_warps"] = num_warps
    p2 = triton.next_power_of_2
    return ({"NOPE": nope, "ROPE": rope, "VDIM": vdim, "BLOCK_ND": max(16, p2(nope)),
             "BLOCK_PD": max(16, p2(rope)), "BLOCK_VD": max(16, p2(vdim)),
             "BLOCK_M": block_m, "BLOCK_N": block_n, "DOT_PREC": "ieee" if fp32 else None},
            opts)


def mla_prefill_fwd(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor,
                    k_pe: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    seq_lens: torch.Tensor, ext_lens: torch.Tensor, q_start_loc: torch.Tensor,
                    kv_start_loc: torch.Tensor, sm_scale: float, max_extend_len: int, *,
                    block_m: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None) -> torch.Tensor:
    """MLA extend attention in the MHA form over ragged, decompressed K/V (module docstring).

    Args:
        q_nope: ``[T, H, N]``; q_pe: ``[T, H, P]`` (rotated) the new tokens' queries.
        k_nope: ``[S, H, N]``, v: ``[S, H, V]``: the decompressed keys and values of every
            extending request's whole sequence (``kv_b_proj`` of its latent rows).
        k_pe: ``[S, P]`` the rotated rope keys (the latent rows' last P values).
        o: ``[T, H, V]`` output, written and returned (rows of no request untouched).
        seq_lens, ext_lens: ``[B]`` int sequence lengths (with the new tokens) and new tokens.
        q_start_loc, kv_start_loc: ``[B]`` int first row of each request in ``T`` / ``S``.
        sm_scale: the softmax scale; max_extend_len: host int >= max(ext_lens).
        block_m, block_n, num_warps: launch overrides (benchmarks).
    Returns:
        ``o``.
    Raises:
        ValueError: shapes that do not fit or a non-unit last stride.
    """
    t, h, n = q_nope.shape
    s, p, vd = k_nope.shape[0], q_pe.shape[-1], v.shape[-1]
    bs = seq_lens.shape[0]
    if q_pe.shape[:2] != (t, h) or k_nope.shape[1:] != (h, n) or k_pe.shape != (s, p) \
            or v.shape[:2] != (s, h) or o.shape != (t, h, vd) or ext_lens.shape[0] != bs \
            or q_start_loc.shape[0] != bs or kv_start_loc.shape[0] != bs:
        raise ValueError(f"mla_prefill_fwd shape mismatch: q_nope {tuple(q_nope.shape)}, q_pe "
                         f"{tuple(q_pe.shape)}, k_nope {tuple(k_nope.shape)}, k_pe "
                         f"{tuple(k_pe.shape)}, v {tuple(v.shape)}, o {tuple(o.shape)}")
    for x in (q_nope, q_pe, k_nope, k_pe, v, o):
        if x.stride(-1) != 1:
            raise ValueError("the last axis of every tensor argument must be unit stride")
    if bs == 0 or t == 0 or max_extend_len <= 0:
        return o
    meta, opts = _prefill_meta(n, p, vd, q_nope.dtype, q_nope.device.type, block_m, block_n,
                               num_warps)
    _mla_prefill_kernel[(bs, h, triton.cdiv(max_extend_len, meta["BLOCK_M"]))](
        q_nope, q_pe, k_nope, k_pe, v, o, seq_lens, ext_lens, q_start_loc, kv_start_loc,
        sm_scale * _LOG2E, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), **meta, **opts)
    return o


__all__ = ["mla_prefill_fwd", "ragged_latent_slots"]
