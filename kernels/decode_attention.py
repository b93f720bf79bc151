"""Paged decode attention in Triton: split-KV ("flash-decoding") with an LSE merge.

Semantics: :func:`kernels.reference.decode_attention_ref`: one query token per request
attends to its whole KV, read from the paged pool through ``req_to_token``.

Algorithm (Dao et al., "Flash-Decoding for long-context inference", 2023; the two-stage
layout follows SGLang's Triton decode backend, written from scratch here):

* Stage 1, grid ``(B, Hkv * head_blocks, max_kv_splits)``: request ``b``'s KV is cut into
  ``num_kv_splits[b]`` contiguous splits (each a multiple of ``BLOCK_N`` tokens). One
  program runs an online softmax (Milakov & Gimelshein 2018) over one split for all the
  query heads that share one KV head (grouped-query attention), so each K/V tile is read
  once per KV head. The query heads of a group are padded to a 16-row block so the
  ``q @ k^T`` and ``p @ v`` products run on ``tl.dot`` (tensor cores / XMX). For plain
  multi-head attention (group size 1) the padding would waste 15/16 of the rows, so that
  case uses an elementwise multiply-and-reduce instead. The program writes the
  normalised partial output and its log-sum-exp (natural log) to fp32 workspaces.
  Programs whose split index is ``>= num_kv_splits[b]`` exit at once, so the grid size
  is static (CUDA-graph friendly) while the work follows each request's split count.
* Stage 2, grid ``(B, Hq)``: merges the splits with weights ``exp(lse_i - max lse)``.
  A request with a single split (every request of a large batch) is written by stage 1
  straight into the output, and stage 2 returns at once for it (on the H200 the merge of
  one split cost 0.28 ms of a 6.5 ms bs64 Llama-3-8B decode step).

Variants (:mod:`kernels.attention_variants`; ``tl.constexpr`` switches, off by default):
``sliding_window`` W starts the KV at ``seq_len - W`` before the split, so only the window's
~W keys are read; ``logit_softcap`` caps the scaled scores (:func:`scale_scores`); ``sinks``
join the softmax denominator once, in stage 2 (stage 1 for one split: :func:`sink_normalise`).

FP8 KV cache (``KV_FP8``, set when the pool has 1-byte elements; a constexpr, so the 16/32-bit
build is unchanged): per-tensor ``k_scale``/``v_scale``; the query is pre-scaled by
``sm_scale * k_scale`` and converted to fp16 once per program (:func:`fp8_kv_query`), the
K/V tiles are converted e4m3/e5m2 -> fp16 in registers in their load layout
(:func:`fp8_kv_tiles`), the dots run in fp16 and the output is scaled by ``v_scale`` once.
No pass over the pool, no bf16 copy (docs/benchmarks.md, "FP8 KV cache that pays", has the
PTX counts that led here).

There is no host synchronisation anywhere (no ``.item()``/``.tolist()``): split counts
come from :func:`choose_num_kv_splits`, computed with device tensor ops.

Launch configuration (documented choices, not tuned per GPU model; see ``_stage1_meta``):
K/V tiles of ``BLOCK_N = 64`` tokens (32 for fp32, head_dim > 128 or the elementwise MHA
path, to bound registers), ``num_warps = 4`` (8 for fp32) and ``num_stages = 2``
(double-buffered K/V loads). XPU: the ``tl.dot`` (GQA) path gets twice the warps and 2
stages (``kernels.launch.dot_kernel_options``: its sub-groups are 16 lanes there); the
elementwise MHA path and stage 2 keep CUDA's values (32-lane sub-groups). Nothing keys off
the CUDA compute capability. Checked with ptxas for sm_90 (bf16, D = 128, GQA 4): 78
registers, no spills; MHA path 128 registers. Stage 2 is a few microseconds:
``num_warps = 4`` for head_dim >= 128, else 2.

Split defaults per device (:data:`DEFAULT_WAVES`, the ``waves`` of
:func:`choose_num_kv_splits` without ``--decode-attention-waves``): 1 on CUDA (swept on the
H200 with ``bench/kernels/sweep_decode.py``); 4 on XPU, where the count is of Xe cores (20 on an Arc
B580, 64 per Data Center GPU Max stack, against the H200's 132 SMs) and each Xe core keeps
several work-groups resident: one program per Xe core leaves a small batch's KV read by 20
programs. Not yet swept on an XPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_variants import variant_launch_args
from kernels.launch import dot_kernel_options

DEFAULT_MIN_CHUNK = 32  # tokens; see choose_num_kv_splits (bench/kernels/sweep_decode.py on the H200)
#: ``waves`` of :func:`choose_num_kv_splits` per device type (module docstring); 1 elsewhere
DEFAULT_WAVES = {"cuda": 1, "xpu": 4}


def default_waves(device_type: str) -> int:
    """Stage-1 programs wanted per SM / Xe core on ``device_type`` (:data:`DEFAULT_WAVES`)."""
    return DEFAULT_WAVES.get(device_type, 1)


@triton.jit
def scale_scores(qk, qk_scale, cap_log2, SOFTCAP: tl.constexpr):
    """Raw ``q . k`` products to log2-domain logits. Without SOFTCAP ``qk_scale`` is
    ``sm_scale * log2(e)``; with it ``qk_scale = sm_scale / cap`` and ``cap_log2 = cap *
    log2(e)``: ``cap * tanh(sm_scale * qk / cap)`` in log2 units. tanh is built from exp2
    as ``sign(x) (1 - e) / (1 + e)``, ``e = exp(-2|x|)`` (no overflow; portable to every
    backend and the interpreter)."""
    if SOFTCAP:
        x = qk * qk_scale
        e = tl.exp2(tl.abs(x) * -2.8853900817779268)    # exp(-2|x|)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0.0, -t, t) * cap_log2
    else:
        return qk * qk_scale


@triton.jit
def sink_normalise(acc, m_i, l_i, sink_log2):
    """``acc / (l_i + exp2(sink - m_i))`` computed stably: the final output of an online
    softmax (running max ``m_i``, sum ``l_i``, both log2 domain) whose denominator also holds
    a sink logit ``sink_log2`` (log2 units) with no value. An empty row (``m_i = -inf``)
    gives 0."""
    m_f = tl.maximum(m_i, sink_log2)
    a = tl.exp2(m_i - m_f)
    den = l_i * a + tl.exp2(sink_log2 - m_f)
    return acc * (a / den)[:, None]


@triton.jit
def fp8_kv_query(q, q_scale):
    """The query of an FP8 KV cache in the dtype of the dots: ``q * q_scale`` (``q_scale =
    sm_scale * k_scale``: the keys' scale and the softmax scale folded into the one query
    row instead of every key) in fp16, the type e4m3/e5m2 convert to in one instruction
    (``cvt.rn.f16x2.e4m3x2`` on sm_89+); the scores' own scale is then ``qk_scale /
    sm_scale``."""
    return (q.to(tl.float32) * q_scale).to(tl.float16)


@triton.jit
def fp8_kv_tiles(k, v, mask_kv):
    """FP8 K/V tiles ``[BLOCK_N, BLOCK_D]`` to fp16 in registers, in the layout they were
    loaded in. ``tl.where`` on V anchors its conversion there: without it Triton converts V
    after its shared-memory stage, in the ``p @ v`` operand layout, with one ``ld.shared.b8``
    per element (8-bit operands have no transposing ``ldmatrix``; ptxas for sm_90: 64 byte
    loads per thread per tile), where this stores the fp16 tile and reads it back with
    ``ldmatrix.trans`` as the bf16 path does. K, the ``q @ k^T`` operand, is contiguous
    along the reduction and keeps vector shared loads either way."""
    return k.to(tl.float16), tl.where(mask_kv, v.to(tl.float16), 0.0)


@triton.jit
def _decode_stage1_kernel(
    q_ptr, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
    part_o, part_lse, o_ptr, qk_scale, max_splits, window, cap_log2, sinks_ptr, q_scale, v_scale,
    stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    stride_pob, stride_poh, stride_pos, stride_peb, stride_peh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_HEAD_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr = False,
):
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = pid_h // NUM_HEAD_BLOCKS
    hblk = pid_h % NUM_HEAD_BLOCKS

    n_splits = tl.minimum(tl.maximum(tl.load(num_kv_splits + b), 1), max_splits)
    if split < n_splits:
        seq_len = tl.load(seq_lens + b)
        row = tl.load(req_pool_indices + b).to(tl.int64)
        if SLIDING:
            # the query (position seq_len - 1) sees the last `window` keys: the splits
            # share those only, so no program reads a key outside the window
            kv_lo = tl.maximum(seq_len - window, 0)
            split_len = tl.cdiv(tl.cdiv(seq_len - kv_lo, n_splits), BLOCK_N) * BLOCK_N
            lo = kv_lo + split * split_len
        else:
            split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
            lo = split * split_len
        hi = tl.minimum(lo + split_len, seq_len)

        offs_g = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_g < GROUP
        q_heads = kv_head * GROUP + offs_g
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        b64 = b.to(tl.int64)
        q = tl.load(q_ptr + b64 * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        if KV_FP8:
            q = fp8_kv_query(q, q_scale)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        k_base = k_buf + kv_head * stride_kbh
        v_base = v_buf + kv_head * stride_vbh
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=mask_n,
                            other=0).to(tl.int64)
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_base + slots[:, None] * stride_kbs + offs_d[None, :],
                        mask=mask_kv, other=0.0)
            # V is loaded with K, so a short split waits for memory once
            v = tl.load(v_base + slots[:, None] * stride_vbs + offs_d[None, :],
                        mask=mask_kv, other=0.0)
            if KV_FP8:
                k, v = fp8_kv_tiles(k, v, mask_kv)
            if USE_DOT:
                qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)
            else:
                qk = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), 2)
            qk = tl.where(mask_n[None, :], scale_scores(qk, qk_scale, cap_log2, SOFTCAP),
                          float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if USE_DOT:
                acc += tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
            else:
                acc += tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), 1)
            m_i = m_new
        if KV_FP8:
            acc = acc * v_scale   # the values' per-tensor scale, once per program

        # An empty split (possible after rounding split_len up to BLOCK_N) has l_i == 0:
        # it contributes weight 0 (lse = -inf) and a zero partial output.
        nonempty = l_i > 0.0
        l_safe = tl.where(nonempty, l_i, 1.0)
        out = tl.where(nonempty[:, None], acc / l_safe[:, None], 0.0)
        lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        if n_splits == 1:
            # one split is the whole answer: write it and let stage 2 skip this request
            if HAS_SINKS:
                sink = tl.load(sinks_ptr + q_heads, mask=mask_h, other=0.0) * 1.4426950408889634
                out = sink_normalise(acc, m_i, l_i, sink)
            tl.store(o_ptr + b64 * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
        else:
            tl.store(part_o + b64 * stride_pob + q_heads[:, None] * stride_poh
                     + split * stride_pos + offs_d[None, :],
                     out, mask=mask_h[:, None] & mask_d[None, :])
            tl.store(part_lse + b64 * stride_peb + q_heads * stride_peh + split, lse,
                     mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    part_o, part_lse, o_ptr, num_kv_splits, max_splits, sinks_ptr,
    stride_pob, stride_poh, stride_pos, stride_peb, stride_peh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_splits = tl.minimum(tl.maximum(tl.load(num_kv_splits + b), 1), max_splits)
    if n_splits == 1:
        return  # stage 1 wrote this request's output directly
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(part_lse + b * stride_peb + h * stride_peh + offs_s, mask=mask_s,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        # the sink joins the denominator here, once per request and head (never per split)
        sink = tl.load(sinks_ptr + h)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)   # all splits empty (seq_len 0): weights 0
    w = tl.exp(lse - m)
    parts = tl.load(part_o + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos
                    + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    num = tl.sum(w[:, None] * parts, 0)
    den = tl.sum(w, 0)
    if HAS_SINKS:
        den += tl.exp(sink - m)
    out = tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=mask_d)


def choose_num_kv_splits(seq_lens: torch.Tensor, num_kv_heads: int, max_kv_splits: int,
                         num_sms: int, *, min_chunk: int = DEFAULT_MIN_CHUNK,
                         waves: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-request KV split counts for :func:`decode_attention_fwd`, on the device.

    Rule: ``splits[b] = clamp(min(seq_lens[b] // min_chunk, fill), 1, max_kv_splits)`` where
    ``fill = ceil(waves * num_sms / (B * num_kv_heads))`` is how many splits per (request,
    KV head) it takes for the stage-1 grid to give every SM ``waves`` programs. So a split is never shorter
    than ``min_chunk`` tokens on average (``ceil(seq_len / splits) >= min_chunk``; a lone
    split may be shorter when the whole sequence is), and large batches get one split.

    Args:
        seq_lens: ``[B]`` int32/int64 KV lengths (tokens), on the device.
        num_kv_heads: KV heads of the layer.
        max_kv_splits: upper bound (the workspaces' split axis); >= 1.
        num_sms: streaming multiprocessors (CUDA) or Xe cores (XPU).
        min_chunk: shortest split worth its stage-2 merge cost, in tokens.
        waves: stage-1 programs wanted per SM (more hides memory latency better).
        out: optional ``[B]`` int32 tensor to write into (a graph's static buffer).

    Returns:
        ``[B]`` int32 tensor on ``seq_lens.device``; values in ``[1, max_kv_splits]``.

    Raises:
        ValueError: ``max_kv_splits < 1`` or ``min_chunk < 1``.

    Only shape arithmetic happens on the host, so this is graph capturable.
    """
    if max_kv_splits < 1 or min_chunk < 1 or waves < 1:
        raise ValueError("max_kv_splits, min_chunk and waves must be >= 1")
    bs = seq_lens.shape[0]
    fill = -(-max(num_sms, 1) * waves // max(bs * num_kv_heads, 1))
    fill = max(1, min(fill, max_kv_splits))
    splits = torch.clamp(torch.div(seq_lens, min_chunk, rounding_mode="floor"), 1, fill)
    if out is None:
        return splits.to(torch.int32)
    out.copy_(splits)
    return out


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs must not silently drop to tf32 on NVIDIA tensor cores; 16-bit inputs use
    # the backend's default (not every backend accepts "tf32").
    return "ieee" if dtype == torch.float32 else None


def fp8_kv_scales(k_buffer: torch.Tensor, qk_scale: float, sm_scale: float, k_scale: float,
                  v_scale: float) -> tuple[float, float, bool]:
    """``(qk_scale, q_scale, fp8)`` for a pool: an FP8 one (1-byte elements) gets the
    query pre-scaled by ``q_scale = sm_scale * k_scale`` and the scores' scale divided by
    ``sm_scale``; any other pool keeps ``qk_scale`` (and the kernels ignore ``q_scale``).

    Raises:
        ValueError: an FP8 pool with ``sm_scale``, ``k_scale`` or ``v_scale`` <= 0.
    """
    if k_buffer.element_size() != 1:
        return qk_scale, 1.0, False
    if sm_scale <= 0 or k_scale <= 0 or v_scale <= 0:
        raise ValueError(f"an FP8 KV cache needs positive sm_scale, k_scale and v_scale, got "
                         f"{sm_scale}, {k_scale}, {v_scale}")
    return qk_scale / sm_scale, sm_scale * k_scale, True


def _stage1_meta(group: int, head_dim: int, dtype: torch.dtype, device_type: str,
                 block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, kv_fp8: bool = False) -> tuple[dict, dict]:
    """Constexprs and launch options of stage 1 (see the module docstring for the choices).

    ``kv_fp8``: the pool holds FP8 (the ``KV_FP8`` path; its dots run in fp16, so the fp32
    query's tile choices do not apply). Returns ``(constexprs, options)``; the compile test
    uses it to build the same variants.
    """
    if kv_fp8:
        dtype = torch.float16
    use_dot = group > 1
    block_h = min(max(16, triton.next_power_of_2(group)), 64) if use_dot else 1
    fp32 = dtype == torch.float32
    if block_n is None:
        # The elementwise (MHA) path holds a [BLOCK_N, BLOCK_D] fp32 product per tile.
        block_n = 32 if (fp32 or head_dim > 128 or not use_dot) else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError("block_n must be a power of two >= 16")
    # Never keyed on the CUDA compute capability. fp32 tiles need 8 warps not to spill. XPU:
    # the tl.dot path runs 16-lane sub-groups (kernels/launch.py), the MHA path 32-lane ones.
    warps = 8 if fp32 else 4
    options = dot_kernel_options(warps, 2, device_type) if use_dot else \
        {"num_warps": warps, "num_stages": 2}
    options = {"num_warps": num_warps or options["num_warps"],
               "num_stages": num_stages or options["num_stages"]}
    constexprs = {
        "GROUP": group, "HEAD_DIM": head_dim, "NUM_HEAD_BLOCKS": triton.cdiv(group, block_h),
        "BLOCK_H": block_h, "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_N": block_n, "USE_DOT": use_dot, "DOT_PREC": _dot_precision(dtype),
        "KV_FP8": kv_fp8,   # False: the 16/32-bit build, code unchanged
    }
    return constexprs, options


def _stage2_meta(head_dim: int, max_kv_splits: int) -> tuple[dict, dict]:
    block_d = max(16, triton.next_power_of_2(head_dim))
    return ({"HEAD_DIM": head_dim, "BLOCK_D": block_d,
             "BLOCK_S": triton.next_power_of_2(max_kv_splits)},
            {"num_warps": 4 if block_d >= 128 else 2})


def _check_decode_args(q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, seq_lens,
                       max_kv_splits: int) -> None:
    bs, hq, d = q.shape
    hkv = k_buffer.shape[1]
    if hq % hkv or k_buffer.shape[2] != d or v_buffer.shape != k_buffer.shape \
            or o.shape != q.shape or req_pool_indices.shape[0] != bs \
            or seq_lens.shape[0] != bs:
        raise ValueError(f"decode_attention_fwd shape mismatch: q {tuple(q.shape)}, pool "
                         f"{tuple(k_buffer.shape)}, o {tuple(o.shape)}, B={bs}")
    if q.stride(2) != 1 or o.stride(2) != 1 or k_buffer.stride(2) != 1 \
            or v_buffer.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("the last axis of q, o, the pool and req_to_token must be unit stride")
    if max_kv_splits < 1:
        raise ValueError("max_kv_splits must be >= 1")


def _decode_workspaces(q: torch.Tensor, max_kv_splits: int, attn_logits: torch.Tensor | None,
                       attn_lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The split workspaces: the caller's (checked) or fresh ones."""
    bs, hq, d = q.shape
    if attn_logits is None:
        attn_logits = torch.empty((bs, hq, max_kv_splits, d), dtype=torch.float32,
                                  device=q.device)
    if attn_lse is None:
        attn_lse = torch.empty((bs, hq, max_kv_splits), dtype=torch.float32, device=q.device)
    if attn_logits.dtype != torch.float32 or attn_logits.shape[0] < bs \
            or tuple(attn_logits.shape[1:]) != (hq, max_kv_splits, d) \
            or attn_logits.stride(3) != 1:
        raise ValueError(f"attn_logits must be fp32 [>={bs}, {hq}, {max_kv_splits}, {d}], "
                         f"got {attn_logits.dtype} {tuple(attn_logits.shape)}")
    if attn_lse.dtype != torch.float32 or attn_lse.shape[0] < bs \
            or tuple(attn_lse.shape[1:]) != (hq, max_kv_splits) or attn_lse.stride(2) != 1:
        raise ValueError(f"attn_lse must be fp32 [>={bs}, {hq}, {max_kv_splits}], "
                         f"got {attn_lse.dtype} {tuple(attn_lse.shape)}")
    return attn_logits, attn_lse


def _auto_splits(seq_lens: torch.Tensor, hkv: int, max_kv_splits: int,
                 num_sms: int | None) -> torch.Tensor:
    if num_sms is None:
        raise ValueError("pass num_kv_splits, or num_sms to choose them")
    return choose_num_kv_splits(seq_lens, hkv, max_kv_splits, num_sms)


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         o: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         sm_scale: float, num_kv_splits: torch.Tensor | None = None,
                         max_kv_splits: int = 16, attn_logits: torch.Tensor | None = None,
                         attn_lse: torch.Tensor | None = None, *, block_n: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None,
                         num_sms: int | None = None, sliding_window: int | None = None,
                         logit_softcap: float | None = None,
                         sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> torch.Tensor:
    """Paged decode attention (split-KV + LSE merge, grouped query heads), in Triton.

    Args:
        q: ``[B, Hq, D]`` query of the one new token per request (fp16/bf16/fp32; last axis
            unit stride), at position ``seq_lens[b] - 1``.
        k_buffer, v_buffer: ``[S, Hkv, D]`` pool tensors of this layer; ``Hq % Hkv == 0``.
        o: ``[B, Hq, D]`` output, written in place (its dtype) and returned.
        req_to_token: ``[R, max_context]`` int32 slot table.
        req_pool_indices: ``[B]`` int rows of ``req_to_token``.
        seq_lens: ``[B]`` int KV lengths including the new token (0 gives a zero output).
        sm_scale: softmax scale, usually ``D ** -0.5`` (Gemma: ``query_pre_attn_scalar **
            -0.5``).
        num_kv_splits: ``[B]`` int32 split counts (values clamped to ``[1, max_kv_splits]``),
            or None to compute them with :func:`choose_num_kv_splits`.
        max_kv_splits: size of the split axis of the workspaces and of the stage-1 grid.
        attn_logits: optional fp32 workspace ``[>=B, Hq, max_kv_splits, D]`` (partial outputs).
        attn_lse: optional fp32 workspace ``[>=B, Hq, max_kv_splits]`` (log-sum-exp, natural log).
        block_n, num_warps, num_stages: stage-1 launch overrides for benchmarking (None:
            the defaults).
        num_sms: the device's multiprocessors (``engine.device.multiprocessor_count``), needed
            only when ``num_kv_splits`` is None (kernels/ does not ask the device itself).
        sliding_window: W: only the last W keys (the query's own included) are attended;
            the splits cut those W, so the kernel reads ~W keys. None: all.
        logit_softcap: cap: scores ``cap * tanh(s / cap)`` after the scale (Gemma 2).
        sinks: ``[Hq]`` float32 per-head logits in the softmax denominator only (gpt-oss);
            merged once, in stage 2 (or stage 1 for a single split).
        k_scale, v_scale: an FP8 pool's per-tensor scales (keys ``k_buffer * k_scale``).

    Returns:
        ``o``.

    Raises:
        ValueError: inconsistent shapes, workspaces of the wrong shape/dtype, neither
            ``num_kv_splits`` nor ``num_sms`` given, a variant out of range, or a non-positive
            scale with an FP8 pool.

    No host synchronisation: safe inside CUDA/XPU graph capture when every tensor argument
    (including ``num_kv_splits`` and the workspaces) is a static buffer.
    """
    _check_decode_args(q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, seq_lens,
                       max_kv_splits)
    (bs, hq, d), hkv = q.shape, k_buffer.shape[1]
    (qk_scale, window, cap_log2, sinks), switches = variant_launch_args(
        hq, sm_scale, sliding_window, logit_softcap, sinks)
    qk_scale, q_scale, fp8 = fp8_kv_scales(k_buffer, qk_scale, sm_scale, k_scale, v_scale)
    if bs == 0:
        return o
    attn_logits, attn_lse = _decode_workspaces(q, max_kv_splits, attn_logits, attn_lse)
    if num_kv_splits is None:
        num_kv_splits = _auto_splits(seq_lens, hkv, max_kv_splits, num_sms)
    meta1, opts1 = _stage1_meta(hq // hkv, d, q.dtype, q.device.type, block_n, num_warps,
                                num_stages, kv_fp8=fp8)
    grid1 = (bs, hkv * meta1["NUM_HEAD_BLOCKS"], max_kv_splits)
    _decode_stage1_kernel[grid1](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, num_kv_splits,
        attn_logits, attn_lse, o, qk_scale, max_kv_splits, window, cap_log2, sinks,
        q_scale, v_scale, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), o.stride(0), o.stride(1), **meta1, **switches,
        **opts1)
    meta2, opts2 = _stage2_meta(d, max_kv_splits)
    _decode_stage2_kernel[(bs, hq)](
        attn_logits, attn_lse, o, num_kv_splits, max_kv_splits, sinks,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), o.stride(0), o.stride(1), **meta2,
        HAS_SINKS=switches["HAS_SINKS"], **opts2,
    )
    return o


__all__ = ["DEFAULT_MIN_CHUNK", "choose_num_kv_splits", "decode_attention_fwd", "fp8_kv_scales"]
