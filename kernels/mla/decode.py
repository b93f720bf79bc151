"""Paged MLA decode attention in Triton, in the absorbed form, with split-KV and an LSE merge.

Semantics: :func:`kernels.mla.reference.mla_attention_ref` for one new token per request.
Each request's query is ``[q_latent (R) | q_rope (P)]`` per head (``q_nope`` already mapped
through ``W_UK``); every key is the token's latent row ``[c (R) | k_rope (P)]`` of the
:class:`~engine.kv.pool.LatentKVPool` (one row shared by all heads), read through
``req_to_token``; the values are the same rows' first R columns. The output is ``[B, H, R]``
in the latent space (the layer maps it through ``W_UV``).

Why this is fast: all heads share one latent row, so a program takes a block of
``BLOCK_H`` heads (the ``tl.dot`` M) and loads each ``[BLOCK_N, R + P]`` tile once for all
of them; the tile is both the keys (``q_lat @ c^T + q_pe @ k_pe^T``, two dots) and the
values (``p @ c``, a third dot on the same tile), so the KV is read once per head block, not
once per head (DeepSeek-V3's 128 heads in blocks of 64: 64x less traffic than an MHA kernel
over decompressed K/V, which would also have to decompress it).

``SPLIT_V = 2`` (a constexpr; 1 builds the single-program code): two programs per head
block, each accumulating half of the R value columns (``[BLOCK_H, R / 2]``: the 64-head
block's fp32 accumulator does not fit one warpgroup's registers whole) and each computing
the whole score tile, from its own half of the tile (which it also multiplies by ``p``) and
the other half (keys only). Their ``lse`` is the same; the first stores it.

Stage 1, grid ``(cdiv(H, BLOCK_H) * SPLIT_V, B, max_splits)`` (the programs that read the
same tiles side by side in launch order, so the second read is an L2 hit): request ``b``'s
tokens are cut into ``num_kv_splits[b]`` splits (multiples of ``BLOCK_N``); one program runs
an online softmax over one split for its head block and writes the normalised partial
``[BLOCK_H, R / SPLIT_V]`` and its log-sum-exp to fp32 workspaces, or, for a request with
one split, the output itself. Stage 2 is :mod:`kernels.decode_attention`'s merge
(``HEAD_DIM = R``), which returns at once for a one-split request. Programs past a
request's split count exit, so the grid is static and the launch can be captured in a
device graph: no host synchronisation here.

FP8 latent cache (``KV_FP8``, set when the pool has 1-byte elements; a constexpr, so the
16/32-bit build is unchanged): the pool holds ``latent / kv_scale`` in e4m3 (or e5m2), the
paged pool's convention (:mod:`kernels.decode_attention`): both query parts are pre-scaled
by ``sm_scale * kv_scale`` and converted to fp16 once per program
(:func:`kernels.decode_attention.fp8_kv_query`), each tile is converted to fp16 in registers
right after its load (one instruction per pair on sm_89+; a ``tl.where`` keeps Triton from
moving the cast of the value operand after the shared-memory stage, where 8-bit elements
have no transposing ``ldmatrix``: ptxas for sm_90a counted 128 ``ld.shared.b8`` a thread a
tile and unpipelined tile loads without it), the three dots run in fp16 with fp32
accumulation, and the output is scaled by ``kv_scale`` once. The tile's read from HBM is
half the bf16 one; its conversion costs one ``cvt`` per pair in every program that reads it.

Launch configuration: :mod:`kernels.mla.decode_config` (a table keyed by head count and
latent dtype, with the roofline arithmetic of each choice; ``config=`` overrides it) through
:func:`_mla_meta`; XPU doubles the warps (:mod:`kernels.launch`) and keeps the pre-table
``16x32x4x2``. A table config that does not fit the device's shared memory (the 64-head
rows take up to 216 KB, the H200's limit being 227 KB) falls back to ``16x32x4x2`` (an
A100: the pre-table kernel) or ``16x16x4x2`` (sm_89's 99 KB with an FP8 latent).
Roofline (H200, DeepSeek-V3's 128 heads, R 512, P 64, bf16): a request's decode reads
``context x 1,152`` bytes of latent a layer and does ``context x 128 x 2,176`` FLOPs of dots
(242 FLOP/byte, above the ridge of 989 TFLOP/s / 4.8 TB/s = 206): bs64 x 4k is 302 MB (63
us) and 73 GFLOP (74 us at peak); ``SPLIT_V = 2`` computes the scores twice (111 GFLOP, 113
us at peak). bs1 x 4k is 4.7 MB and 1.1 GFLOP: a latency figure (33 splits x 4 programs
on the 132 SMs, 128 tokens each: two 64-token tiles). Measured before the table
(``16x32x4x2``, 17 splits x 8 programs of 256 tokens): 676 and 24.2 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import (
    _decode_stage2_kernel,
    _stage2_meta,
    choose_num_kv_splits,
    fp8_kv_query,
    fp8_kv_scales,
)
from kernels.launch import dot_kernel_options
from kernels.mla.decode_config import SMALL_SMEM_CONFIGS, MLADecodeConfig, mla_decode_config

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_stage1_kernel(
    q_lat, q_pe, latent, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
    part_o, part_lse, o_ptr, qk_scale, max_splits, num_heads, q_scale, kv_scale,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_ls, stride_r2t,
    stride_pob, stride_poh, stride_pos, stride_peb, stride_peh, stride_ob, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, SPLIT_V: tl.constexpr = 1,
):
    # axis 0: head block x value part, so the programs of one (request, split), which read
    # the same latent tiles, are launched side by side (the second read is an L2 hit)
    hblk = tl.program_id(0) // SPLIT_V
    vpart = tl.program_id(0) % SPLIT_V
    b = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.minimum(tl.maximum(tl.load(num_kv_splits + b), 1), max_splits)
    if split < n_splits:
        seq_len = tl.load(seq_lens + b)
        row = tl.load(req_pool_indices + b).to(tl.int64)
        split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, seq_len)

        offs_h = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < num_heads
        # this program's value columns (all R of them when SPLIT_V == 1) and, with SPLIT_V
        # == 2, the other half, which the scores need too
        offs_v = vpart * (BLOCK_R // SPLIT_V) + tl.arange(0, BLOCK_R // SPLIT_V)
        mask_v = offs_v < RANK
        offs_w = (1 - vpart) * (BLOCK_R // SPLIT_V) + tl.arange(0, BLOCK_R // SPLIT_V)
        mask_w = offs_w < RANK
        offs_p = tl.arange(0, BLOCK_P)
        mask_p = offs_p < ROPE
        b64 = b.to(tl.int64)
        q_base = q_lat + b64 * stride_qlb + offs_h[:, None] * stride_qlh
        ql = tl.load(q_base + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :],
                     other=0.0)
        qp = tl.load(q_pe + b64 * stride_qpb + offs_h[:, None] * stride_qph + offs_p[None, :],
                     mask=mask_h[:, None] & mask_p[None, :], other=0.0)
        if KV_FP8:   # sm_scale * kv_scale folded into the query; fp16 dots
            ql = fp8_kv_query(ql, q_scale)
            qp = fp8_kv_query(qp, q_scale)
        dot_dtype = ql.dtype
        if SPLIT_V == 2:
            qw = tl.load(q_base + offs_w[None, :], mask=mask_h[:, None] & mask_w[None, :],
                         other=0.0)
            if KV_FP8:
                qw = fp8_kv_query(qw, q_scale)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R // SPLIT_V], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=mask_n,
                            other=0).to(tl.int64)
            base = latent + slots[:, None] * stride_ls
            mask_c = mask_n[:, None] & mask_v[None, :]
            kp = tl.load(base + RANK + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :],
                         other=0.0).to(dot_dtype)
            c = tl.load(base + offs_v[None, :], mask=mask_c, other=0.0)
            if KV_FP8:
                # converted where it was loaded: the tl.where keeps Triton from moving the
                # cast after the shared-memory stage, where the p @ c operand (reduced along
                # the tile's rows) would be gathered one ld.shared.b8 per element
                c = tl.where(mask_c, c.to(dot_dtype), 0.0)
            qk = tl.dot(ql, tl.trans(c), input_precision=DOT_PREC)
            if SPLIT_V == 2:   # the other half's scores: keys only, no p @ c
                cw = tl.load(base + offs_w[None, :], mask=mask_n[:, None] & mask_w[None, :],
                             other=0.0).to(dot_dtype)
                qk += tl.dot(qw, tl.trans(cw), input_precision=DOT_PREC)
            qk += tl.dot(qp.to(dot_dtype), tl.trans(kp), input_precision=DOT_PREC)
            qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), c, input_precision=DOT_PREC)
            m_i = m_new
        if KV_FP8:
            acc = acc * kv_scale   # the values' per-tensor scale, once per program

        # an empty split (split_len rounded up to BLOCK_N) has l_i == 0: weight 0 in stage 2
        nonempty = l_i > 0.0
        l_safe = tl.where(nonempty, l_i, 1.0)
        out = tl.where(nonempty[:, None], acc / l_safe[:, None], 0.0)
        mask_o = mask_h[:, None] & mask_v[None, :]
        if n_splits == 1:
            tl.store(o_ptr + b64 * stride_ob + offs_h[:, None] * stride_oh + offs_v[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=mask_o)
        else:
            lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453,
                           float("-inf"))
            tl.store(part_o + b64 * stride_pob + offs_h[:, None] * stride_poh
                     + split * stride_pos + offs_v[None, :], out, mask=mask_o)
            if vpart == 0:   # the value halves share the scores: one lse
                tl.store(part_lse + b64 * stride_peb + offs_h * stride_peh + split, lse,
                         mask=mask_h)


def _mla_meta(rank: int, rope: int, dtype: torch.dtype, device_type: str,
              block_n: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None, kv_fp8: bool = False,
              config: MLADecodeConfig | None = None, num_heads: int = 128
              ) -> tuple[dict, dict]:
    """Constexprs and launch options of stage 1: ``config`` (None: the table's for
    ``num_heads`` and the latent, :func:`kernels.mla.decode_config.mla_decode_config`), with
    ``block_n``, ``num_warps``, ``num_stages`` overriding its fields. ``kv_fp8``: an FP8
    latent pool, whose dots run in fp16 whatever the query's dtype. XPU doubles the warps
    (:mod:`kernels.launch`).

    Raises:
        ValueError: a ``block_n`` that is not a power of two >= 16; ``split_v = 2`` with
            ``R < 32`` (a half of fewer than 16 columns).
    """
    cfg = config or mla_decode_config(num_heads, kv_fp8, dtype, device_type)
    if kv_fp8:
        dtype = torch.float16
    fp32 = dtype == torch.float32
    block_n = block_n or cfg.block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError("block_n must be a power of two >= 16")
    block_r = max(16, triton.next_power_of_2(rank))
    if cfg.split_v > 1 and block_r // cfg.split_v < 16:
        raise ValueError(f"split_v {cfg.split_v} needs kv_lora_rank >= {16 * cfg.split_v}")
    opts = dot_kernel_options(num_warps or cfg.num_warps, num_stages or cfg.num_stages,
                              device_type)
    return ({"RANK": rank, "ROPE": rope, "BLOCK_H": cfg.block_h, "BLOCK_R": block_r,
             "BLOCK_P": max(16, triton.next_power_of_2(rope)), "BLOCK_N": block_n,
             "DOT_PREC": "ieee" if fp32 else None, "KV_FP8": kv_fp8,
             "SPLIT_V": cfg.split_v}, opts)


def mla_head_blocks(num_heads: int, kv_fp8: bool = False,
                    config: MLADecodeConfig | None = None) -> int:
    """Stage-1 programs per (request, split): ``cdiv(num_heads, BLOCK_H) * SPLIT_V`` of
    ``config`` (None: the table's for ``num_heads`` over a 16-bit or, ``kv_fp8``, an FP8
    latent)."""
    cfg = config or mla_decode_config(num_heads, kv_fp8)
    return triton.cdiv(num_heads, cfg.block_h) * cfg.split_v


def mla_split_cap(batch_size: int, num_heads: int, num_sms: int, waves: int,
                  max_kv_splits: int, *, kv_fp8: bool = False,
                  config: MLADecodeConfig | None = None) -> int:
    """The split axis of a batch of ``batch_size``: at most the splits that give every SM
    ``waves`` stage-1 programs (``cdiv(waves * num_sms, B * programs)``, programs per split
    of :func:`mla_head_blocks`: 4 for 128 heads in the table's 64-head blocks, so bs1 gets
    33 splits and bs >= 33 one), at most ``max_kv_splits``, at least 1. A host int of the
    batch size alone, so the workspaces of a graph of that size are static; it also bounds
    them (``B * H * splits * R`` fp32 values stay near ``waves * num_sms * BLOCK_H / SPLIT_V
    * R`` whatever B is)."""
    progs = max(batch_size * mla_head_blocks(num_heads, kv_fp8, config), 1)
    fill = -(-max(num_sms, 1) * max(waves, 1) // progs)
    return max(1, min(fill, max_kv_splits))


def choose_mla_splits(seq_lens: torch.Tensor, num_heads: int, max_splits: int, num_sms: int,
                      *, waves: int = 1, min_chunk: int = 64, kv_fp8: bool = False,
                      config: MLADecodeConfig | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-request split counts (``[B]`` int32, on the device, no host sync): as
    :func:`kernels.decode_attention.choose_num_kv_splits` with the stage-1 programs per
    split (:func:`mla_head_blocks`) in the place of the KV heads, never more than
    ``max_splits`` (:func:`mla_split_cap`) and never a split shorter than ``min_chunk``
    tokens on average."""
    return choose_num_kv_splits(seq_lens, mla_head_blocks(num_heads, kv_fp8, config),
                                max_splits, num_sms, min_chunk=min_chunk, waves=waves, out=out)


def mla_decode_workspaces(batch_size: int, num_heads: int, max_splits: int, rank: int,
                          device, flat: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(partial outputs [B, H, S, R], lse [B, H, S])``: fresh, or views of the
    front of ``flat`` (a 1-D fp32 buffer of at least ``B * H * S * (R + 1)`` values: a graph's
    static workspace, shared by the batch sizes).

    Raises:
        ValueError: ``flat`` is too small.
    """
    n_o = batch_size * num_heads * max_splits * rank
    n = n_o + batch_size * num_heads * max_splits
    if flat is None:
        flat = torch.empty(n, dtype=torch.float32, device=device)
    if flat.numel() < n:
        raise ValueError(f"MLA decode workspace of {flat.numel()} values < {n}")
    return (flat[:n_o].view(batch_size, num_heads, max_splits, rank),
            flat[n_o:n].view(batch_size, num_heads, max_splits))


#: stage-1 launches of the table (meta, options, query dtype, device type) that did not fit
#: the device's shared memory -> the (meta, options) of the first fallback that did
_FITS: dict = {}


def _launch_stage1(args: tuple, shape: tuple[int, int, int], meta: dict, opts: dict,
                   remeta) -> None:
    """Stage 1 over ``shape = (H, B, max_splits)``. ``remeta``: None (a configuration the
    caller chose: errors propagate) or a callable giving a config's ``(meta, opts)``: when
    the table's does not fit the device's shared memory (Triton raises ``OutOfResources``
    on the host, before anything is enqueued: safe in graph capture too), the first of
    :data:`kernels.mla.decode_config.SMALL_SMEM_CONFIGS` that fits runs, from then on.

    Raises:
        triton.runtime.OutOfResources: a chosen config, or no fallback, fits.
    """
    key = (repr(meta), repr(opts), args[0].dtype, args[0].device.type)
    if remeta is not None and key in _FITS:
        meta, opts = _FITS[key]
        remeta = None
    tries = [(meta, opts)] + ([remeta(c) for c in SMALL_SMEM_CONFIGS] if remeta else [])
    h, bs, max_splits = shape
    for i, (m, o) in enumerate(tries):
        grid = (triton.cdiv(h, m["BLOCK_H"]) * m["SPLIT_V"], bs, max_splits)
        try:
            _mla_decode_stage1_kernel[grid](*args, **m, **o)
        except triton.runtime.OutOfResources:
            if i == len(tries) - 1:
                raise
            continue
        if i:
            _FITS[key] = (m, o)
        return


def _check_mla_args(q_lat, q_pe, latent, o, req_to_token, req_pool_indices, seq_lens,
                    max_splits: int) -> torch.Tensor:
    """The latent as ``[S, R + P]``; raises ValueError as :func:`mla_decode_fwd` says."""
    bs, h, r = q_lat.shape
    lat = latent.reshape(latent.shape[0], -1) if latent.dim() == 3 else latent
    if q_pe.shape[:2] != (bs, h) or o.shape != q_lat.shape or lat.shape[1] != r + q_pe.shape[-1] \
            or req_pool_indices.shape[0] != bs or seq_lens.shape[0] != bs:
        raise ValueError(f"mla_decode_fwd shape mismatch: q_lat {tuple(q_lat.shape)}, q_pe "
                         f"{tuple(q_pe.shape)}, latent {tuple(latent.shape)}, o "
                         f"{tuple(o.shape)}, B={bs}")
    for x in (q_lat, q_pe, lat, o, req_to_token):
        if x.stride(-1) != 1:
            raise ValueError("the last axis of every tensor argument must be unit stride")
    if max_splits < 1:
        raise ValueError("max_splits must be >= 1")
    return lat


def mla_decode_fwd(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                   o: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   seq_lens: torch.Tensor, sm_scale: float, num_kv_splits: torch.Tensor,
                   max_splits: int, attn_logits: torch.Tensor | None = None,
                   attn_lse: torch.Tensor | None = None, *, kv_scale: float = 1.0,
                   config: MLADecodeConfig | str | None = None, block_n: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None
                   ) -> torch.Tensor:
    """Absorbed-form MLA decode over the latent pool (module docstring).

    Args:
        q_lat: ``[B, H, R]`` ``q_nope @ W_UK`` of each request's new token (fp16/bf16/fp32,
            last axis unit stride).
        q_pe: ``[B, H, P]`` its rotated rope part (last axis unit stride).
        latent: ``[S, 1, R + P]`` (or ``[S, R + P]``) one layer's latent cache, the new
            tokens stored; unit stride on the last axis. 16/32-bit, or FP8
            (``float8_e4m3fn``/``float8_e5m2``) holding ``latent / kv_scale``.
        o: ``[B, H, R]`` output (the latent-space values), written and returned.
        req_to_token: ``[rows, max_context]`` int32 slot table; req_pool_indices ``[B]``
            its rows; seq_lens ``[B]`` lengths with the new token (0: a zero output).
        sm_scale: the softmax scale.
        num_kv_splits: ``[B]`` int32 splits per request (:func:`choose_mla_splits`).
        max_splits: the split axis (of the grid and the workspaces), >= 1.
        attn_logits, attn_lse: fp32 workspaces ``[>=B, H, max_splits, R]`` and
            ``[>=B, H, max_splits]`` (:func:`mla_decode_workspaces`), or None for fresh.
        kv_scale: an FP8 pool's per-tensor scale (the latent is ``latent * kv_scale``);
            ignored for a wider pool.
        config: the launch configuration (an :class:`MLADecodeConfig` or its tag, e.g.
            ``"64x64x4x2v2"``, ``"legacy"``); None: the table's
            (:data:`kernels.mla.decode_config.MLA_DECODE_TABLE`).
        block_n, num_warps, num_stages: overrides of the configuration's fields (benchmarks).
    Returns:
        ``o``.
    Raises:
        ValueError: shapes that do not fit, a non-unit last stride, ``max_splits < 1``, an
            FP8 pool with ``sm_scale`` or ``kv_scale`` <= 0, a configuration that is not one
            (:meth:`MLADecodeConfig.parse`) or does not fit R (:func:`_mla_meta`).
    """
    lat = _check_mla_args(q_lat, q_pe, latent, o, req_to_token, req_pool_indices, seq_lens,
                          max_splits)
    bs, h, r = q_lat.shape
    qk_scale, q_scale, fp8 = fp8_kv_scales(lat, sm_scale * _LOG2E, sm_scale, kv_scale,
                                           kv_scale)
    cfg = MLADecodeConfig.parse(config) if isinstance(config, str) else config
    meta, opts = _mla_meta(r, q_pe.shape[-1], q_lat.dtype, q_lat.device.type, block_n,
                           num_warps, num_stages, kv_fp8=fp8, config=cfg, num_heads=h)
    if bs == 0:
        return o
    if attn_logits is None or attn_lse is None:
        attn_logits, attn_lse = mla_decode_workspaces(bs, h, max_splits, r, q_lat.device)
    args = (q_lat, q_pe, lat, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
            attn_logits, attn_lse, o, qk_scale, max_splits, h, q_scale, kv_scale,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), lat.stride(0),
            req_to_token.stride(0), attn_logits.stride(0), attn_logits.stride(1),
            attn_logits.stride(2), attn_lse.stride(0), attn_lse.stride(1), o.stride(0),
            o.stride(1))
    remeta = None if cfg is not None else (lambda c: _mla_meta(
        r, q_pe.shape[-1], q_lat.dtype, q_lat.device.type, block_n, num_warps, num_stages,
        kv_fp8=fp8, config=c))
    _launch_stage1(args, (h, bs, max_splits), meta, opts, remeta)
    meta2, opts2 = _stage2_meta(r, max_splits)
    _decode_stage2_kernel[(bs, h)](
        attn_logits, attn_lse, o, num_kv_splits, max_splits, attn_lse,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), o.stride(0), o.stride(1), **meta2,
        HAS_SINKS=False, **opts2)
    return o


__all__ = ["choose_mla_splits", "mla_decode_fwd", "mla_decode_workspaces", "mla_head_blocks",
           "mla_split_cap"]
