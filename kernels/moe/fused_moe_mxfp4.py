"""gpt-oss's fused MoE in Triton: expert biases, the clamped SwiGLU, and MXFP4 expert
weights dequantized in registers (W4A16 style).

The steps of :func:`kernels.moe.fused_moe.fused_moe` (alignment, two grouped GEMMs, the
top-k sum; the same helpers), with a grouped GEMM (:func:`invoke_moe_gemm_oai`) that

- reads the weight tile either as plain floats or, with ``MXFP4``, as packed e2m1 bytes
  (``blocks [E, N, K/2]``: element k of a row in byte ``k // 2``, low nibble for even k)
  and e8m0 scales (``[E, N, K/32]``): each element's byte is loaded, its nibble decoded by
  bit arithmetic (sign bit 3, exponent bits 1-2, mantissa bit 0:
  ``(-1)^s * (e == 0 ? m / 2 : (1 + m / 2) * 2^(e - 1))``), multiplied by
  ``2^(scale - 127)`` and cast to the activations' dtype before ``tl.dot`` (fp32
  accumulation);
- adds the expert's bias row (``[E, N]``) to the fp32 accumulator before the routed weight.

Between the GEMMs, :func:`kernels.moe.reference.swiglu_oai` (torch ops, fp32) or SwiGLU.
Semantics and layouts: :func:`kernels.moe.reference.fused_moe_torch`, :mod:`kernels.moe.mxfp4`.
No host sync: graph capturable. In the Triton interpreter a bf16 ``tl.dot`` is unreliable
(the tests use fp16/fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_ops import silu_and_mul
from kernels.moe.fused_moe import moe_align_block_size, moe_sum
from kernels.moe.moe_config import check_config, get_moe_config
from kernels.moe.mxfp4 import check_mxfp4
from kernels.moe.reference import (
    MOE_ACTIVATIONS,
    check_moe_shapes,
    gelu_tanh_and_mul,
    swiglu_oai,
)


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> fp32 values."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    val = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def _moe_gemm_oai_kernel(a_ptr, b_ptr, s_ptr, bias_ptr, c_ptr, w_ptr, sorted_ptr,
                         expert_ids_ptr, num_post_ptr, N, K, num_pairs, a_row_div,
                         num_m_blocks, group_m, stride_am, stride_be, stride_bn, stride_se,
                         stride_sn, stride_cm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         MUL_ROUTED_WEIGHT: tl.constexpr, MXFP4: tl.constexpr,
                         HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    per_group = group_m * num_n_blocks
    first_m = (pid // per_group) * group_m
    group_size = tl.minimum(num_m_blocks - first_m, group_m)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

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
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if MXFP4:
            byte = tl.load(b_ptr + expert * stride_be + offs_n_ld[None, :] * stride_bn
                           + (kk // 2)[:, None], mask=k_ok[:, None], other=0).to(tl.int32)
            code = (byte >> ((kk % 2) * 4)[:, None]) & 15
            sc = tl.load(s_ptr + expert * stride_se + offs_n_ld[None, :] * stride_sn
                         + (kk // 32)[:, None], mask=k_ok[:, None], other=127).to(tl.int32)
            b = (_e2m1(code) * tl.exp2((sc - 127).to(tl.float32))).to(a.dtype)
        else:
            b = tl.load(b_ptr + expert * stride_be + offs_n_ld[None, :] * stride_bn
                        + kk[:, None], mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc=acc, input_precision=DOT_PREC)
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
        MXFP4=mx, HAS_BIAS=bias is not None,
        DOT_PREC="ieee" if a.dtype == torch.float32 else None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return c


def fused_moe_oai(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: str = "silu", swiglu_alpha: float = 1.702,
                  swiglu_limit: float = 7.0, w13_scales: torch.Tensor | None = None,
                  w2_scales: torch.Tensor | None = None, config: dict | None = None,
                  device_name: str | None = None) -> torch.Tensor:
    """:func:`kernels.moe.reference.fused_moe_torch` (its arguments, biases, activation,
    MXFP4 blocks and scales) in Triton: CUDA, XPU, or the interpreter on the CPU.

    Args:
        config: a launch configuration (:mod:`kernels.moe.moe_config`); None: looked up by
            ``device_name``; with MXFP4 weights ``BLOCK_SIZE_K`` is at least 32.
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
    if config is None:
        config = get_moe_config(m, num_experts, inter, h, top_k, dtype, dev.type, device_name)
    config = dict(check_config(config))
    if mx:
        config["BLOCK_SIZE_K"] = max(32, config["BLOCK_SIZE_K"])
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


__all__ = ["fused_moe_oai", "invoke_moe_gemm_oai"]
