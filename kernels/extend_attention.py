"""Extend (prefill with a cached prefix) attention in Triton.

Semantics: :func:`kernels.reference.extend_attention_ref`. Request ``b`` has
``prefix = seq_lens[b] - extend_seq_lens[b]`` tokens in the paged pool (read through
``req_to_token``) and ``extend_seq_lens[b]`` new tokens at rows ``extend_start_loc[b]...``
of q/k/v_extend. New token ``i`` sees the whole prefix and new tokens ``0..i``.

Algorithm: FlashAttention-2 style tiling with an online softmax (Dao, "FlashAttention-2",
2023). Grid ``(B, Hq, cdiv(max_extend_len, BLOCK_M))``: one program owns ``BLOCK_M`` query
rows of one head of one request and streams K/V tiles of ``BLOCK_N`` tokens in three
phases, keeping the running max / sum / accumulator in fp32 registers:

1. the cached prefix, gathered from the pool through ``req_to_token`` (no causal mask;
   only the last tile is length-masked);
2. new tokens strictly before this query block: fully visible, no mask at all;
3. the diagonal tiles of new tokens: causal mask ``key <= query`` and length mask.

Variants (keyword arguments, each behind a ``tl.constexpr`` switch: without them the
plain kernel): ``key_limit`` (``KEY_LIMIT``) gives each query row its own end of the new
keys it sees (a bidirectional span: phase 3 runs on to the block's furthest limit and masks
``key < limit`` instead of ``key <= query``; phases 1 and 2 are unchanged, as every limit
is past its own query); ``sliding_window`` W starts phase 1 at the first key the block's first
query sees (``prefix + m_lo - W + 1``) and phase 2 at the tile holding ``m_lo - W + 1``,
and masks ``key <= query - W`` in every phase (rows that see no key of a tile keep an
empty running state); ``logit_softcap`` caps the scaled scores and ``sinks`` joins the
final normalisation (``kernels.decode_attention.scale_scores`` / ``sink_normalise``).

The new tokens' K/V are read from ``k_extend``/``v_extend`` even though the caller has
already stored them in the pool, as the reference does. An FP8 pool (``KV_FP8``) is read as
decode reads it (``kernels.decode_attention.fp8_kv_tiles``, fp16 dots, the scales folded into
q and the output), and the new tokens are rounded to its FP8 in registers
(:func:`fp8_kv_as_stored`), as :func:`kernels.kv_store.store_kv` stored them. Non-power-of-two head dims (80,
96, ...) are padded to the next power of two with a mask on the head axis.

Launch configuration (documented, not keyed on the CUDA compute capability; see
``_extend_meta``): ``BLOCK_M = BLOCK_N = 64`` for 16-bit dtypes and head_dim <= 128 (32 x 32
for larger heads, 16 x 16 for fp32, whose ieee dots keep operands in registers),
``num_warps = 4`` for head_dim <= 64 else 8, ``num_stages = 2`` on CUDA; XPU doubles the
warps (``kernels.launch.dot_kernel_options``: the dots run 16-lane sub-groups there, and a
64 x 64 tile with D = 128 on half of CUDA's threads per program would spill).
Checked with ptxas for sm_90 (bf16): D = 128 uses 177 registers, D = 64 156, no spills;
128 x 64 tiles with 8 warps also fit (236 registers) and may be worth a try on an H200
(``block_m=128``; ``bench/kernels/bench_kernels.py --extend-block-m 128``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_variants import variant_launch_args
from kernels.decode_attention import (
    fp8_kv_query,
    fp8_kv_scales,
    fp8_kv_tiles,
    scale_scores,
    sink_normalise,
)
from kernels.launch import dot_kernel_options


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PREC: tl.constexpr,
                         EMPTY_ROWS: tl.constexpr = False):
    """One online-softmax update with the (already scaled, log2-domain) scores ``qk``;
    ``v`` is already in the dtype of the ``p @ v`` product. EMPTY_ROWS: a row may have seen
    no key yet and none in this tile (a sliding window), so its max stays -inf: the update
    then subtracts 0 instead (no ``-inf - -inf`` NaN) and the row keeps l = 0, acc = 0."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if EMPTY_ROWS:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk - m_sub[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def fp8_kv_as_stored(k, v, k_inv, v_inv, mask, KV_TYPE: tl.constexpr):
    """New tokens' K/V rows as an FP8 pool holds them, in fp16 and unscaled like the tiles
    of :func:`kernels.decode_attention.fp8_kv_tiles`: ``x * x_inv`` rounded to ``KV_TYPE``
    the way :func:`kernels.kv_store.store_kv` rounds it (the same expression), so a prompt
    attends to its own tokens exactly as a later chunk or decode step reads them back."""
    k8 = (k.to(tl.float32) * k_inv).to(KV_TYPE)
    v8 = (v.to(tl.float32) * v_inv).to(KV_TYPE)
    return fp8_kv_tiles(k8, v8, mask)


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, k_buf, v_buf,
    req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
    qk_scale, window, cap_log2, sinks_ptr, q_scale, k_inv, v_inv, v_scale, key_limit,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr = False, KEY_LIMIT: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    # Query blocks run last-to-first: the last block of a request sees the most keys, and
    # axis 2 varies slowest in launch order, so the heaviest programs start first and the
    # light ones fill the tail of the wave (the FlashAttention-2 scheduling trick).
    mblk = tl.num_programs(2) - 1 - tl.program_id(2)
    ext_len = tl.load(extend_seq_lens + b)
    m_lo = mblk * BLOCK_M
    if m_lo < ext_len:
        kv_h = h // GROUP
        seq_len = tl.load(seq_lens + b)
        prefix = seq_len - ext_len
        start = tl.load(extend_start_loc + b).to(tl.int64)
        row = tl.load(req_pool_indices + b).to(tl.int64)

        offs_m = m_lo + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(q_ptr + (start + offs_m[:, None]) * stride_qt + h * stride_qh
                    + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        if KV_FP8:
            q = fp8_kv_query(q, q_scale)   # k_scale * sm_scale folded in; fp16 dots
        dot_dtype = q.dtype

        if KEY_LIMIT:  # per row: new keys 0 .. lim - 1 visible (rows past ext_len: causal)
            lim = tl.load(key_limit + start + offs_m, mask=mask_m, other=0)
            lim = tl.where(mask_m, lim, offs_m + 1)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Phase 1: the cached prefix, gathered from the pool. A sliding window starts at the
        # first key the block's first query (position prefix + m_lo) sees.
        if SLIDING:
            p_lo = tl.maximum(prefix + m_lo - window + 1, 0)   # gathered: no alignment
        else:
            p_lo = 0
        kb_base = k_buf + kv_h * stride_kbh
        vb_base = v_buf + kv_h * stride_vbh
        for n0 in range(p_lo, prefix, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix
            slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=mask_n,
                            other=0).to(tl.int64)
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(kb_base + slots[:, None] * stride_kbs + offs_d[None, :], mask=mask_kv,
                        other=0.0)
            if KV_FP8:
                v = tl.load(vb_base + slots[:, None] * stride_vbs + offs_d[None, :],
                            mask=mask_kv, other=0.0)
                k, v = fp8_kv_tiles(k, v, mask_kv)
            qk = scale_scores(tl.dot(q, tl.trans(k.to(dot_dtype)), input_precision=DOT_PREC),
                              qk_scale, cap_log2, SOFTCAP)
            if SLIDING:
                visible = mask_n[None, :] & (offs_n[None, :] > prefix + offs_m[:, None] - window)
                qk = tl.where(visible, qk, float("-inf"))
            else:
                qk = tl.where(mask_n[None, :], qk, float("-inf"))
            if not KV_FP8:
                v = tl.load(vb_base + slots[:, None] * stride_vbs + offs_d[None, :],
                            mask=mask_kv, other=0.0)
            m_i, l_i, acc = _online_softmax_step(qk, v.to(dot_dtype), m_i, l_i, acc, DOT_PREC,
                                                 SLIDING)

        # Phase 2: new tokens before this query block (all visible to every row here, but
        # for a sliding window, which also starts the loop at the first visible tile).
        if SLIDING:
            n_lo = tl.maximum(m_lo - window + 1, 0) // BLOCK_N * BLOCK_N
        else:
            n_lo = 0
        k_base = k_ptr + start * stride_kt + kv_h * stride_kh
        v_base = v_ptr + start * stride_vt + kv_h * stride_vh
        for n0 in range(n_lo, m_lo, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
                        mask=mask_d[None, :], other=0.0)
            if KV_FP8:
                v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :],
                            mask=mask_d[None, :], other=0.0)
                k, v = fp8_kv_as_stored(k, v, k_inv, v_inv, mask_d[None, :],
                                        kb_base.dtype.element_ty)
            qk = scale_scores(tl.dot(q, tl.trans(k.to(dot_dtype)), input_precision=DOT_PREC),
                              qk_scale, cap_log2, SOFTCAP)
            if SLIDING:
                qk = tl.where(offs_n[None, :] > offs_m[:, None] - window, qk, float("-inf"))
            if not KV_FP8:
                v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :],
                            mask=mask_d[None, :], other=0.0)
            m_i, l_i, acc = _online_softmax_step(qk, v.to(dot_dtype), m_i, l_i, acc, DOT_PREC,
                                                 SLIDING)

        # Phase 3: the diagonal block, causal and length masked (with key limits: on to the
        # block's furthest limit, each row masked at its own).
        hi = tl.minimum(ext_len, m_lo + BLOCK_M)
        if KEY_LIMIT:
            hi = tl.minimum(ext_len, tl.maximum(hi, tl.max(lim, 0)))
        for n0 in range(m_lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=mask_kv,
                        other=0.0)
            if KV_FP8:
                v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :],
                            mask=mask_kv, other=0.0)
                k, v = fp8_kv_as_stored(k, v, k_inv, v_inv, mask_kv, kb_base.dtype.element_ty)
            qk = scale_scores(tl.dot(q, tl.trans(k.to(dot_dtype)), input_precision=DOT_PREC),
                              qk_scale, cap_log2, SOFTCAP)
            if KEY_LIMIT:
                visible = mask_n[None, :] & (offs_n[None, :] < lim[:, None])
            else:
                visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
            if SLIDING:
                visible = visible & (offs_n[None, :] > offs_m[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            if not KV_FP8:
                v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :],
                            mask=mask_kv, other=0.0)
            m_i, l_i, acc = _online_softmax_step(qk, v.to(dot_dtype), m_i, l_i, acc, DOT_PREC,
                                                 SLIDING)

        if KV_FP8:
            acc = acc * v_scale   # the values' per-tensor scale, once per program
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + h) * 1.4426950408889634
            out = sink_normalise(acc, m_i, l_i, sink)
        elif SLIDING:
            # a row past ext_len (never stored) may have seen no key in its window
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        else:
            # Every row sees key 0 of phase 1 or 3, so l_i > 0 for all rows.
            out = acc / l_i[:, None]
        tl.store(o_ptr + (start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _extend_meta(group: int, head_dim: int, dtype: torch.dtype, device_type: str,
                 block_m: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, kv_fp8: bool = False,
                 key_limit: bool = False) -> tuple[dict, dict]:
    """Constexprs and launch options (see the module docstring for the choices).

    ``kv_fp8``: an FP8 pool (the ``KV_FP8`` path, fp16 dots whatever the query's dtype);
    ``key_limit``: per-row key limits (the ``KEY_LIMIT`` path).
    Returns ``(constexprs, options)``; the compile test uses it to build the same variants.
    """
    if kv_fp8:
        dtype = torch.float16
    # fp32 dots run on FMA units (ieee) with operands in registers: 16 x 16 tiles do not
    # spill; 16-bit dots use tensor cores (wgmma on sm_90) with 64 x 64 tiles.
    default = 16 if dtype == torch.float32 else (32 if head_dim > 128 else 64)
    block_m = block_m or default
    block_n = block_n or default
    if block_m % block_n or block_n < 16 or block_n & (block_n - 1) or block_m & (block_m - 1):
        raise ValueError("block_m and block_n must be powers of two, block_m a multiple of "
                         "block_n, and block_n >= 16")
    # Never keyed on the CUDA compute capability; XPU: twice the warps (kernels/launch.py).
    options = dot_kernel_options(4 if head_dim <= 64 else 8, 2, device_type)
    if num_warps:
        options["num_warps"] = num_warps
    constexprs = {
        "GROUP": group, "HEAD_DIM": head_dim, "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_M": block_m, "BLOCK_N": block_n,
        # fp32 must not silently drop to tf32; 16-bit inputs use the backend default.
        "DOT_PREC": "ieee" if dtype == torch.float32 else None,
        "KV_FP8": kv_fp8,   # False: the 16/32-bit build, code unchanged
        "KEY_LIMIT": key_limit,   # False: causal, code unchanged
    }
    return constexprs, options


def _check_args(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token,
                req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, key_limit
                ) -> None:
    """:func:`extend_attention_fwd`'s shape, stride and ``key_limit`` checks (ValueError)."""
    t, hq, d = q_extend.shape
    hkv = k_buffer.shape[1]
    bs = req_pool_indices.shape[0]
    if hq % hkv or k_extend.shape != (t, hkv, d) or v_extend.shape != (t, hkv, d) \
            or o_extend.shape != q_extend.shape or k_buffer.shape[2] != d \
            or v_buffer.shape != k_buffer.shape or seq_lens.shape[0] != bs \
            or extend_seq_lens.shape[0] != bs or extend_start_loc.shape[0] != bs:
        raise ValueError(f"extend_attention_fwd shape mismatch: q {tuple(q_extend.shape)}, "
                         f"k {tuple(k_extend.shape)}, v {tuple(v_extend.shape)}, "
                         f"o {tuple(o_extend.shape)}, pool {tuple(k_buffer.shape)}, B={bs}")
    if key_limit is not None and (key_limit.shape != (t,) or key_limit.dtype != torch.int32):
        raise ValueError(f"key_limit must be [T] int32 (T = {t}), not "
                         f"{tuple(key_limit.shape)} {key_limit.dtype}")
    for x in (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token):
        if x.stride(-1) != 1:
            raise ValueError("the last axis of every tensor argument must be unit stride")


def extend_attention_fwd(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                         o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                         extend_start_loc: torch.Tensor, sm_scale: float, max_extend_len: int,
                         *, block_m: int | None = None, block_n: int | None = None,
                         num_warps: int | None = None, sliding_window: int | None = None,
                         logit_softcap: float | None = None,
                         sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                         v_scale: float = 1.0,
                         key_limit: torch.Tensor | None = None) -> torch.Tensor:
    """Extend attention: new tokens over the pooled prefix plus causal self-attention.

    Args:
        q_extend: ``[T, Hq, D]`` queries of the new tokens (fp16/bf16/fp32).
        k_extend, v_extend: ``[T, Hkv, D]`` new keys/values; ``Hq % Hkv == 0``.
        o_extend: ``[T, Hq, D]`` output, written in place (its dtype) and returned. Rows not
            covered by any request's extend range are left untouched.
        k_buffer, v_buffer: ``[S, Hkv, D]`` pool tensors of this layer (prefix K/V).
        req_to_token: ``[R, max_context]`` int32 slot table.
        req_pool_indices: ``[B]`` int rows of ``req_to_token``.
        seq_lens: ``[B]`` int total KV length (prefix + new) per request, in tokens.
        extend_seq_lens: ``[B]`` int new tokens per request (0 allowed).
        extend_start_loc: ``[B]`` int offset of each request's first new token in ``T``.
        sm_scale: softmax scale, usually ``D ** -0.5`` (Gemma: ``query_pre_attn_scalar **
            -0.5``).
        max_extend_len: host int >= max(extend_seq_lens); sizes the grid (too small a value
            leaves rows unwritten).
        block_m, block_n, num_warps: launch overrides for benchmarking (None: defaults).
            ``block_m`` must be a multiple of ``block_n``.
        sliding_window: W: new token i (position ``prefix + i``) sees keys ``prefix + i - W +
            1 .. prefix + i``; the K/V tiles below a query block's window are skipped.
        logit_softcap: cap: scores ``cap * tanh(s / cap)`` after the scale (Gemma 2).
        sinks: ``[Hq]`` float32 per-head logits in the softmax denominator only (gpt-oss).
        k_scale, v_scale: per-tensor scales of an FP8 pool (the prefix keys are ``k_buffer *
            k_scale``); ignored for a 16/32-bit pool. With an FP8 pool the new tokens'
            ``k_extend``/``v_extend`` (the unquantised rows, 16/32-bit) are rounded in
            registers as :func:`kernels.kv_store.store_kv` stores them, so every key is
            attended as stored; the dots run in fp16 with ``k_scale`` folded into q and the
            output scaled by ``v_scale`` once.
        key_limit: ``[T]`` int32, or None (causal). Per row of q_extend: the new token ``i``
            of that row's request sees new keys ``0 .. key_limit[row] - 1`` instead of
            ``0 .. i`` (``key_limit[row] >= i + 1``, at most its request's
            ``extend_seq_lens``): a bidirectional span (Gemma 3's image tokens) gives each
            of its queries the span's end. The window (``sliding_window``) still applies.

    Returns:
        ``o_extend``.

    Raises:
        ValueError: inconsistent shapes, a non-unit-stride last axis, bad block sizes, a
            variant out of range, or an FP8 pool with a non-positive scale.
    """
    _check_args(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token,
                req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc, key_limit)
    hq, hkv, d = q_extend.shape[1], k_buffer.shape[1], q_extend.shape[2]
    bs, t = req_pool_indices.shape[0], q_extend.shape[0]
    (qk_scale, window, cap_log2, sinks), switches = variant_launch_args(
        hq, sm_scale, sliding_window, logit_softcap, sinks)
    qk_scale, q_scale, fp8 = fp8_kv_scales(k_buffer, qk_scale, sm_scale, k_scale, v_scale)
    if bs == 0 or t == 0 or max_extend_len <= 0:
        return o_extend
    meta, opts = _extend_meta(hq // hkv, d, q_extend.dtype, q_extend.device.type, block_m,
                              block_n, num_warps, kv_fp8=fp8, key_limit=key_limit is not None)
    grid = (bs, hq, triton.cdiv(max_extend_len, meta["BLOCK_M"]))
    _extend_kernel[grid](
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        req_to_token, req_pool_indices, seq_lens, extend_seq_lens, extend_start_loc,
        qk_scale, window, cap_log2, sinks, q_scale, 1.0 / k_scale, 1.0 / v_scale, v_scale,
        key_limit if key_limit is not None else seq_lens,
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), o_extend.stride(0), o_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), **meta, **switches, **opts,
    )
    return o_extend


__all__ = ["extend_attention_fwd"]
