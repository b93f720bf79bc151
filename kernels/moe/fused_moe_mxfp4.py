"""gpt-oss's fused MoE in Triton: expert biases, the clamped SwiGLU, and MXFP4 expert
weights dequantized in registers (W4A16 style).

The steps of :func:`kernels.moe.fused_moe.fused_moe` (alignment, two grouped GEMMs, the
top-k sum; the same helpers), with a grouped GEMM (:func:`invoke_moe_gemm_oai`) that

- reads the weight tile either as plain floats or, with ``MXFP4``, as packed e2m1 bytes
  (``blocks [E, N, K/2]``: element k of a row in byte ``k // 2``, low nibble for even k)
  and e8m0 scales (``[E, N, K/32]``). Per K step of ``BLOCK_K``: one ``[BLOCK_K/2,
  BLOCK_N]`` byte tile, K-contiguous in each weight row (16-byte vector loads, pipelined
  through shared memory), and one ``[BLOCK_K/32, BLOCK_N]`` scale tile, broadcast over
  the 16 bytes of its group. The low nibbles are the even K rows of the weights, the high
  nibbles the odd rows; a dot over K does not care about the order, so the step is two
  dots, ``acc += a[:, 0::2] @ W_lo + a[:, 1::2] @ W_hi`` (the activation tile is loaded
  contiguously and split). Decoding (:func:`_mxfp4_tile`) is bit arithmetic: the nibble
  ``s e1 e0 m`` moved to fp16's sign and top mantissa bits is ``value * 2^-14`` (e == 0:
  an fp16 subnormal), converted exactly to fp32 and multiplied by the power of two
  ``2^(scale - 127 + 14)`` built from its exponent field ``(scale + 14) << 23``; then
  cast to the activations' dtype (the product is exact in fp32, as the reference's;
  scale bytes above 240 overflow to inf, factors over 2^113 no checkpoint has). No
  ``exp2``, no select; fp32 accumulation;
- adds the expert's bias row (``[E, N]``) to the fp32 accumulator before the routed weight.

Between the GEMMs, :func:`kernels.moe.reference.swiglu_oai` (torch ops, fp32) or SwiGLU.
MXFP4 experts at decode sizes (``M <= FERRY_MXFP4_GEMV_MAX_M``, default 4) take the two
GEMV-shaped launches of :mod:`kernels.moe.fused_moe_mxfp4_gemv` instead (no ``tl.dot``
tile padded from one row to 16, no alignment, no separate activation or top-k sum).
Semantics and layouts: :func:`kernels.moe.reference.fused_moe_torch`, :mod:`kernels.moe.mxfp4`.
No host sync: graph capturable. In the Triton interpreter a bf16 ``tl.dot`` is unreliable
(the tests use fp16/fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_ops import silu_and_mul
from kernels.moe.fused_moe import grouped_block_ids, moe_align_block_size, moe_sum
from kernels.moe.fused_moe_mxfp4_gemv import fused_moe_oai_gemv, use_gemv_path
from kernels.moe.moe_config import check_config, get_moe_config
from kernels.moe.mxfp4 import check_mxfp4
from kernels.moe.reference import (
    MOE_ACTIVATIONS,
    check_moe_shapes,
    gelu_tanh_and_mul,
    swiglu_oai,
)


@triton.jit
def _mxfp4_tile(byte, scale_byte, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A ``[BLOCK_K/2, BLOCK_N]`` tile of MXFP4 bytes (int, 0..255) and its
    ``[BLOCK_K/32, BLOCK_N]`` e8m0 scales -> the fp32 weights of the even rows (low
    nibbles) and of the odd rows (high nibbles), each ``[BLOCK_K/2, BLOCK_N]``, exact.

    A nibble ``s e1 e0 m`` moved bitwise to fp16's sign bit and to the top three bits of
    its mantissa (``s << 15 | (e1 e0 m) << 9``) is the fp16 number ``value * 2^-14``
    (e == 0 lands in the subnormals: 0 or 2^-15; e > 0 in the normals: no exp2, no select).
    The fp16 -> fp32 conversion is exact, and the scale ``2^(s - 127)`` times the 2^14 is
    one fp32 power of two built from its exponent field, ``(s + 14) << 23`` (exact for the
    scale bytes 0..240, factors up to 2^113; larger bytes give inf)."""
    # both nibbles at once, one fp16 pattern per 16-bit half of a 32-bit word: the
    # magnitudes (byte bits 0-2, 4-6) to bits 9-11 and 25-27 by b * (2^9 + 2^21), the
    # signs (bits 3, 7) to bits 15 and 31 by b * (2^12 + 2^24); the shifted copies of
    # a byte do not overlap, so each product is the two shifts at once
    b = byte.to(tl.uint32)
    word = ((b * 0x200200) & 0x0E000E00) | ((b * 0x1001000) & 0x80008000)
    lo = word & 0xFFFF
    hi = word >> 16
    scale = (tl.minimum(scale_byte.to(tl.int32) + 14, 255) << 23).to(tl.float32, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)),
                       (BLOCK_K // 2, BLOCK_N))
    w_lo = lo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    w_hi = hi.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    return w_lo, w_hi


@triton.jit
def _mxfp4_step(acc, a_ptrs, b_ptrs, s_ptrs, row_ok, k_left, MASK_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_PREC: tl.constexpr):
    """One K step of the MXFP4 GEMM: ``acc [BLOCK_M, BLOCK_N]`` fp32 plus the activation
    tile ``[BLOCK_M, BLOCK_K]`` times the weights of the byte tile ``[BLOCK_K/2, BLOCK_N]``
    and scale tile ``[BLOCK_K/32, BLOCK_N]`` at the pointers; with ``MASK_K`` only the
    first ``k_left`` (a multiple of 32) elements of K count."""
    if MASK_K:
        offs_k = tl.arange(0, BLOCK_K)
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < k_left)[None, :], other=0.0)
        byte = tl.load(b_ptrs, mask=(tl.arange(0, BLOCK_K // 2) < k_left // 2)[:, None],
                       other=0)
        sc = tl.load(s_ptrs, mask=(tl.arange(0, BLOCK_K // 32) < k_left // 32)[:, None],
                     other=0)
    else:
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        byte = tl.load(b_ptrs)
        sc = tl.load(s_ptrs)
    # a contiguous (vectorised) activation tile, split into its even/odd columns
    a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
    w_lo, w_hi = _mxfp4_tile(byte, sc, BLOCK_K, BLOCK_N)
    acc = tl.dot(a_even, w_lo.to(a_even.dtype), acc=acc, input_precision=DOT_PREC)
    return tl.dot(a_odd, w_hi.to(a_odd.dtype), acc=acc, input_precision=DOT_PREC)


@triton.jit
def _moe_gemm_oai_kernel(a_ptr, b_ptr, s_ptr, bias_ptr, c_ptr, w_ptr, sorted_ptr,
                         expert_ids_ptr, num_post_ptr, N, K, num_pairs, a_row_div,
                         num_m_blocks, group_m, stride_am, stride_be, stride_bn, stride_se,
                         stride_sn, stride_cm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         MUL_ROUTED_WEIGHT: tl.constexpr, MXFP4: tl.constexpr,
                         HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    pid_m, pid_n = grouped_block_ids(N, BLOCK_N, num_m_blocks, group_m)

    num_post = tl.load(num_post_ptr)
    if pid_m * BLOCK_M >= num_post:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    a_row = pair // a_row_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_ld = (offs_n % N).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MXFP4:
        # bytes [BLOCK_K/2, BLOCK_N], K-contiguous per weight row (vector loads along K);
        # byte j of a row holds elements 2j (low nibble) and 2j + 1 (high nibble), so the
        # activations split into their even and odd columns and the tile is two dots
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + expert * stride_be + offs_n_ld[None, :] * stride_bn + offs_kb[:, None]
        s_ptrs = s_ptr + expert * stride_se + offs_n_ld[None, :] * stride_sn + offs_g[:, None]
        # full K steps without masks; a partial last step (K = 2880 is 11.25 steps of
        # 256) runs once after the loop with them
        k_full = K // BLOCK_K * BLOCK_K
        for _k0 in range(0, k_full, BLOCK_K):
            acc = _mxfp4_step(acc, a_ptrs, b_ptrs, s_ptrs, row_ok, BLOCK_K, False, BLOCK_M,
                              BLOCK_K, BLOCK_N, DOT_PREC)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 32
        if not EVEN_K:
            acc = _mxfp4_step(acc, a_ptrs, b_ptrs, s_ptrs, row_ok, K - k_full, True,
                              BLOCK_M, BLOCK_K, BLOCK_N, DOT_PREC)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + expert * stride_be + offs_n_ld[None, :] * stride_bn + offs_k[:, None]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - k0
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc=acc, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * N + offs_n_ld).to(tl.float32)
        acc = acc + bias[None, :]
    if MUL_ROUTED_WEIGHT:
        w = tl.load(w_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n[None, :] < N))


def invoke_moe_gemm_oai(a: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None,
                        bias: torch.Tensor | None, c: torch.Tensor,
                        topk_weights: torch.Tensor | None, sorted_token_ids: torch.Tensor,
                        expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor,
                        a_row_div: int, config: dict) -> torch.Tensor:
    """One grouped GEMM as :func:`kernels.moe.fused_moe.invoke_moe_gemm`, with
    ``c[t] = (a[t // a_row_div] @ W[e_t]^T + bias[e_t]) * topk_weight[t]``.

    Args:
        a: ``[rows, K]`` activations, unit last stride.
        w: ``[E, N, K]`` floats of a's dtype, or with ``scales`` MXFP4 blocks
            ``[E, N, K/32, 16]`` uint8 (K a multiple of 32).
        scales: ``[E, N, K/32]`` uint8 e8m0 scales, or None (float weights).
        bias: ``[E, N]`` contiguous, or None.
        c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, a_row_div,
            config: as :func:`kernels.moe.fused_moe.invoke_moe_gemm`.
    Returns:
        ``c``.
    Raises:
        ValueError: non-contiguous weights, scales or bias.
    """
    cfg = check_config(config)
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    n, k = w.shape[1], a.shape[1]
    if not w.is_contiguous() or (scales is not None and not scales.is_contiguous()) \
            or (bias is not None and not bias.is_contiguous()):
        raise ValueError("invoke_moe_gemm_oai: weights, scales and bias must be contiguous")
    num_m_blocks = sorted_token_ids.shape[0] // bm
    mx = scales is not None
    grid = (num_m_blocks * triton.cdiv(n, bn),)
    _moe_gemm_oai_kernel[grid](
        a, w, scales if mx else w, bias if bias is not None else c, c,
        topk_weights if topk_weights is not None else c, sorted_token_ids, expert_ids,
        num_tokens_post_padded, n, k, c.shape[0], a_row_div, num_m_blocks,
        cfg["GROUP_SIZE_M"], a.stride(0), w.stride(0), w.stride(1),
        scales.stride(0) if mx else 0, scales.stride(1) if mx else 0, c.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, MUL_ROUTED_WEIGHT=topk_weights is not None,
        MXFP4=mx, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        DOT_PREC="ieee" if a.dtype == torch.float32 else None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return c


#: the largest dequantized tile (BLOCK_SIZE_K x BLOCK_SIZE_N weights) a looked-up
#: configuration's K step is widened to (sm_90: 16 x 64 x 256, 4 warps: 175 registers;
#: 32 x 128 x 256 spills)
MXFP4_MAX_TILE = 64 * 256


def mxfp4_block_k(config: dict, looked_up: bool) -> int:
    """``BLOCK_SIZE_K`` of the MXFP4 GEMMs for a launch configuration: at least 32 (one
    scale group; each of the two dots then reduces over 16). A configuration looked up
    for the bf16 experts (``looked_up``) gets its K step doubled, up to 256 and while the
    dequantized tile stays within :data:`MXFP4_MAX_TILE` weights: an MXFP4 K step moves a
    quarter of the bf16 bytes (0.53 bytes a weight), so doubling it keeps half the bytes
    in flight per pipeline stage that the bf16 tile has (decode at 16 x 64 tiles:
    ``64 x 128`` bytes + 8 scale rows a stage instead of 4 KiB)."""
    bk = max(32, config["BLOCK_SIZE_K"])
    if looked_up and bk < 256 and 2 * bk * config["BLOCK_SIZE_N"] <= MXFP4_MAX_TILE:
        bk *= 2
    return bk


def fused_moe_oai(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: str = "silu", swiglu_alpha: float = 1.702,
                  swiglu_limit: float = 7.0, w13_scales: torch.Tensor | None = None,
                  w2_scales: torch.Tensor | None = None, config: dict | None = None,
                  device_name: str | None = None, gemv: bool | None = None) -> torch.Tensor:
    """:func:`kernels.moe.reference.fused_moe_torch` (its arguments, biases, activation,
    MXFP4 blocks and scales) in Triton: CUDA, XPU, or the interpreter on the CPU.

    Args:
        config: a launch configuration (:mod:`kernels.moe.moe_config`); None: looked up by
            ``device_name``; with MXFP4 weights ``BLOCK_SIZE_K`` is at least 32.
        gemv: MXFP4 experts only: run :func:`kernels.moe.fused_moe_mxfp4_gemv.fused_moe_oai_gemv`
            (two GEMV-shaped launches) instead of the grouped GEMM; None: when no ``config``
            is given and ``M <= GEMV_MAX_M`` (``FERRY_MXFP4_GEMV_MAX_M``, default 4).
    Returns:
        New ``[M, H]`` tensor in the activations' dtype.
    Raises:
        ValueError: bad shapes or dtypes, an unknown activation.
    """
    dtype, dev = hidden_states.dtype, hidden_states.device
    m, h = hidden_states.shape
    mx = w13_scales is not None
    if mx:
        check_mxfp4(w13, w13_scales)
        check_mxfp4(w2, w2_scales)
        num_experts, two_i = w13.shape[0], w13.shape[1]
        meta = (torch.empty((num_experts, two_i, h), dtype=dtype, device="meta"),
                torch.empty((num_experts, h, two_i // 2), dtype=dtype, device="meta"))
        check_moe_shapes(hidden_states, *meta, topk_weights, topk_ids)
    else:
        check_moe_shapes(hidden_states, w13, w2, topk_weights, topk_ids)
        num_experts, two_i = w13.shape[0], w13.shape[1]
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"fused_moe: unknown activation {activation!r} "
                         f"({', '.join(MOE_ACTIVATIONS)})")
    inter, top_k = two_i // 2, topk_ids.shape[1]
    out = torch.empty((m, h), dtype=dtype, device=dev)
    if m == 0:
        return out
    if mx and (gemv or (gemv is None and config is None and use_gemv_path(m))):
        return fused_moe_oai_gemv(hidden_states, w13, w2, w13_scales, w2_scales,
                                  topk_weights.to(torch.float32).contiguous(),
                                  topk_ids.contiguous(), w13_bias=w13_bias, w2_bias=w2_bias,
                                  activation=activation, swiglu_alpha=swiglu_alpha,
                                  swiglu_limit=swiglu_limit, out=out)
    looked_up = config is None
    if looked_up:
        config = get_moe_config(m, num_experts, inter, h, top_k, dtype, dev.type, device_name)
    config = dict(check_config(config))
    if mx:
        config["BLOCK_SIZE_K"] = mxfp4_block_k(config, looked_up)
    topk_ids = topk_ids.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"],
                                                            num_experts)
    num_pairs = m * top_k
    w13v = w13.flatten(2) if mx else w13
    w2v = w2.flatten(2) if mx else w2
    gate_up = torch.empty((num_pairs, 2 * inter), dtype=dtype, device=dev)
    invoke_moe_gemm_oai(hidden_states, w13v, w13_scales, w13_bias, gate_up, None, sorted_ids,
                        expert_ids, num_post, top_k, config)
    if activation == "swiglu_oai":
        act = swiglu_oai(gate_up, swiglu_alpha, swiglu_limit).to(dtype)
    elif activation == "gelu_tanh":
        act = gelu_tanh_and_mul(gate_up).to(dtype)
    else:
        act = silu_and_mul(gate_up)
    down = torch.empty((num_pairs, h), dtype=dtype, device=dev)
    invoke_moe_gemm_oai(act, w2v, w2_scales, w2_bias, down, weights, sorted_ids, expert_ids,
                        num_post, 1, config)
    return moe_sum(down, topk_ids, num_experts, out)


__all__ = ["MXFP4_MAX_TILE", "fused_moe_oai", "invoke_moe_gemm_oai", "mxfp4_block_k"]
