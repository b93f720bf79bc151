"""The fused MoE with block-wise FP8 expert weights (DeepSeek-V3's experts, Qwen3-MoE-FP8):
e4m3 ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` with fp32 scales per ``[bn, bk]`` block.

The steps of :func:`kernels.moe.fused_moe.fused_moe` (alignment, two grouped GEMMs, SwiGLU,
the top-k sum; the same helpers), with a grouped GEMM (:func:`invoke_moe_gemm_fp8`) that
reads the e4m3 weight tile, upcasts it in registers to the activations' dtype (exact),
multiplies (fp32 accumulation) and scales each K step's partial by the block's scale:
``BLOCK_SIZE_K`` is the scales' ``bk``, so a step reads one column of scales
(``scales [E, R, ceil(K/bk)]``, scale row ``n // row_div`` for weight row ``n``; ``row_div``
is ``bn``, or 1 for one row of scales per weight row). Weight-only (W8A16) at every M: the
activations are not quantized, so the result is the float experts' on the dequantized
weights (:func:`kernels.moe.reference.fused_moe_torch` on
:func:`kernels.moe.reference.dequantize_fp8_block_experts`, the CPU path). No host sync:
graph capturable. In the interpreter the tests use fp16/fp32 activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fused_ops import silu_and_mul
from kernels.moe.fused_moe import grouped_block_ids, moe_align_block_size, moe_sum
from kernels.moe.moe_config import check_config, get_moe_config


@triton.jit
def _moe_gemm_fp8_kernel(a_ptr, b_ptr, s_ptr, c_ptr, w_ptr, sorted_ptr, expert_ids_ptr,
                         num_post_ptr, N, K, num_pairs, a_row_div, num_m_blocks, group_m,
                         row_div, stride_am, stride_be, stride_bn, stride_se, stride_sn,
                         stride_cm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         MUL_ROUTED_WEIGHT: tl.constexpr, DOT_PREC: tl.constexpr):
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
    offs_n_ld = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n_ld[None, :].to(tl.int64) * stride_bn \
        + offs_k[:, None]
    s_ptrs = s_ptr + expert * stride_se + (offs_n_ld // row_div).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        scale = tl.load(s_ptrs + k0 // BLOCK_K)
        part = tl.dot(a, b.to(a.dtype), input_precision=DOT_PREC)
        acc += part * scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        w = tl.load(w_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n[None, :] < N))


def invoke_moe_gemm_fp8(a: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, row_div: int,
                        c: torch.Tensor, topk_weights: torch.Tensor | None,
                        sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                        num_tokens_post_padded: torch.Tensor, a_row_div: int,
                        config: dict) -> torch.Tensor:
    """:func:`kernels.moe.fused_moe.invoke_moe_gemm` with ``w [E, N, K]`` float8_e4m3fn and
    ``scales [E, R, ceil(K / BLOCK_SIZE_K)]`` fp32 (``row_div`` weight rows per scale row);
    ``config["BLOCK_SIZE_K"]`` must be the scales' ``bk``. Returns ``c``."""
    cfg = check_config(config)
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    n, k = w.shape[1], w.shape[2]
    if scales.shape[2] != triton.cdiv(k, bk):
        raise ValueError(f"fused MoE FP8: scales {tuple(scales.shape)} do not cover K = {k} "
                         f"in blocks of {bk}")
    num_m_blocks = sorted_token_ids.shape[0] // bm
    grid = (num_m_blocks * triton.cdiv(n, bn),)
    _moe_gemm_fp8_kernel[grid](
        a, w, scales, c, topk_weights if topk_weights is not None else c, sorted_token_ids,
        expert_ids, num_tokens_post_padded, n, k, c.shape[0], a_row_div, num_m_blocks,
        cfg["GROUP_SIZE_M"], row_div, a.stride(0), w.stride(0), w.stride(1),
        scales.stride(0), scales.stride(1), c.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_PREC="ieee" if a.dtype == torch.float32 else None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return c


def fused_moe_fp8_block(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                        w13_scale: torch.Tensor, w2_scale: torch.Tensor, block_k: int,
                        w13_row_div: int, w2_row_div: int, config: dict | None = None,
                        device_name: str | None = None) -> torch.Tensor:
    """The experts of an MoE layer with block-FP8 weights (see the module docstring).

    Args:
        hidden_states: ``[M, H]`` fp16/bf16/fp32, unit last stride.
        w13: ``[E, 2I, H]`` e4m3 (gate rows, then up rows); w2: ``[E, H, I]`` e4m3.
        topk_weights, topk_ids: ``[M, top_k]`` (fp32 weights; ids outside ``[0, E)`` are
            dropped).
        w13_scale: ``[E, R13, ceil(H / block_k)]`` fp32; w2_scale: ``[E, R2, ceil(I /
            block_k)]`` fp32; ``w13_row_div`` / ``w2_row_div`` weight rows per scale row.
        block_k: the scales' K block, a power of two >= 16.
        config: launch configuration (its ``BLOCK_SIZE_K`` is replaced by ``block_k``);
            None looks it up as :func:`kernels.moe.fused_moe.fused_moe` does.
    Returns:
        New ``[M, H]`` tensor in the activations' dtype.
    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    m, h = hidden_states.shape
    e, two_i, h13 = w13.shape
    inter = two_i // 2
    if h13 != h or tuple(w2.shape) != (e, h, inter) or w13.dtype != torch.float8_e4m3fn \
            or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fused MoE FP8: hidden {tuple(hidden_states.shape)}, w13 "
                         f"{tuple(w13.shape)} {w13.dtype}, w2 {tuple(w2.shape)} {w2.dtype} "
                         "(want e4m3 [E, 2I, H] and [E, H, I])")
    dtype, dev = hidden_states.dtype, hidden_states.device
    top_k = topk_ids.shape[1]
    out = torch.empty((m, h), dtype=dtype, device=dev)
    if m == 0:
        return out
    if config is None:
        config = get_moe_config(m, e, inter, h, top_k, dtype, dev.type, device_name)
    config = check_config(dict(config, BLOCK_SIZE_K=block_k))
    topk_ids = topk_ids.contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], e)
    num_pairs = m * top_k
    gate_up = torch.empty((num_pairs, two_i), dtype=dtype, device=dev)
    invoke_moe_gemm_fp8(hidden_states.contiguous(), w13, w13_scale, w13_row_div, gate_up,
                        None, sorted_ids, expert_ids, num_post, top_k, config)
    act = silu_and_mul(gate_up)
    down = torch.empty((num_pairs, h), dtype=dtype, device=dev)
    invoke_moe_gemm_fp8(act, w2, w2_scale, w2_row_div, down, weights, sorted_ids, expert_ids,
                        num_post, 1, config)
    return moe_sum(down, topk_ids, e, out)
