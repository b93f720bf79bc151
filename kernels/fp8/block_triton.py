"""Block-wise FP8 GEMM in Triton (one path for CUDA and XPU): e4m3 weights ``[N, K]`` with
fp32 scales per ``[bn, bk]`` block (``bk`` = the kernel's ``BLOCK_K``, so each step of the K
loop reads one column of scales), and the per-token, per-group activation quantizer. The
numerics are the block-wise section of :mod:`kernels.fp8.reference`.

- :func:`quantize_act_groups_triton`: one program per token (its row as a tile of groups of
  ``bk`` columns): ``xq [M, K]`` e4m3 and ``sx [M, Kb]`` fp32.
- :func:`fp8_block_linear`: W8A8 (``xq`` codes, ``tl.dot`` of two e4m3 tiles on FP8 tensor
  cores, or of their exact fp16 upcasts where Triton has no FP8 dot, ``UPCAST``), the fp32
  partial of each K step multiplied by ``sx[:, j] * S[:, j]`` before it is accumulated; or
  weight-only (``quant_x=False``, small M): the e4m3 weight tile is upcast in registers to
  x's dtype (exact), multiplied with x and the partial scaled by ``S[:, j]``. K may be split
  over programs (``kernels.split_k``) so that a decode-sized matmul keeps every SM loading
  weights.

The interpreter runs every mode with fp16/fp32 operands (tests/kernels/test_triton_fp8_block.py);
the e4m3 ``tl.dot`` is checked on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8.constants import FP8_DTYPE, FP8_MAX, SCALE_EPS
from kernels.launch import dot_kernel_options
from kernels.split_k import split_k_launch, split_k_trusted


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s, K, NUM_GROUPS,
                         FMAX: tl.constexpr, EPS: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK_G: tl.constexpr):
    # one program per token: its row as a [groups, GROUP] tile, one amax per group
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), EPS) / FMAX
    q = tl.minimum(tl.maximum(x / scale[:, None], -FMAX), FMAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + g, scale, mask=g < NUM_GROUPS)


def quantize_act_groups_triton(x: torch.Tensor, group: int
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kernels.fp8.reference.quantize_act_groups`: one program per
    token, which reads its row once.

    Args:
        x: [M, K] float (unit column stride), M >= 1.
        group: columns per scale, a power of two >= 16.
    Returns:
        ``(xq [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32)``.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    kb = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    block_g = triton.next_power_of_2(kb)
    elems = block_g * group
    warps = 4 if elems <= 2048 else (8 if elems <= 8192 else 16)
    _quant_groups_kernel[(m,)](x, q, s, x.stride(0), q.stride(0), s.stride(0), k, kb,
                               FMAX=FP8_MAX, EPS=SCALE_EPS, GROUP=group, BLOCK_G=block_g,
                               num_warps=warps)
    return q, s


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, y_ptr, part_ptr, lock_ptr,
                           M, N, K, k_per_split, row_div,
                           stride_am, stride_sam, stride_wn, stride_swn, stride_ym,
                           A_FP8: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                           SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    sw_rows = sw_ptr + (offs_n // row_div).to(tl.int64) * stride_swn
    sa_rows = sa_ptr + offs_m.to(tl.int64) * stride_sam
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        kb = k0 // BLOCK_K
        kk = k0 + offs_k
        k_mask = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        sw = tl.load(sw_rows + kb, mask=n_mask, other=0.0)
        if A_FP8:
            if UPCAST:   # e4m3 is exact in fp16, and so is each product in fp32
                part = tl.dot(a.to(tl.float16), tl.trans(w.to(tl.float16)))
            else:        # e4m3 x e4m3 on the FP8 tensor cores, fp32 accumulation
                part = tl.dot(a, tl.trans(w))
            sa = tl.load(sa_rows + kb, mask=m_mask, other=0.0)
            acc += part * sa[:, None] * sw[None, :]
        else:            # weight-only: upcast the codes to x's dtype, scale the partial
            if IEEE:
                part = tl.dot(a, tl.trans(w.to(a.dtype)), input_precision="ieee")
            else:
                part = tl.dot(a, tl.trans(w.to(a.dtype)))
            acc += part * sw[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # the fp32 partial of this K part; the last of the SPLIT_K programs of this (M, N)
        # block to arrive sums them in K order and resets its counter (kernels/split_k.py)
        mn = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + mn, acc, mask=out_mask)
        tl.debug_barrier()
        lock = lock_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + mn, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")


def block_gemm_config(m: int, n: int, k: int, block_k: int, weight_only: bool,
                      device_type: str = "cuda") -> dict:
    """Launch parameters of :func:`fp8_block_linear` (``BLOCK_K`` is always the scales'
    ``block_k``). Decode sizes (M <= 64) take 16-64 rows x 64 columns and split K so that
    about 2048 (weight-only) or 256 (W8A8) programs stream the weights (at most 8 parts; no
    split on XPU, :func:`kernels.split_k.split_k_trusted`); larger M 64 or 128 rows x 128
    columns, no split. A first rule, to be checked by ``bench.kernels.sweep_gemm_fp8_block``
    on the H200."""
    block_m = max(16, triton.next_power_of_2(m))
    if block_m <= 64:
        n_blocks = triton.cdiv(n, 64)
        target = 2048 if weight_only else 256
        split = max(1, min(8, target // n_blocks, triton.cdiv(k, block_k))) \
            if split_k_trusted(device_type) else 1
        return dict(SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=64,
                    **dot_kernel_options(4, 4, device_type))
    if m <= 512:
        return dict(SPLIT_K=1, BLOCK_M=64, BLOCK_N=128, **dot_kernel_options(4, 3, device_type))
    return dict(SPLIT_K=1, BLOCK_M=128, BLOCK_N=128, **dot_kernel_options(8, 3, device_type))


def fp8_block_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                     block_k: int, row_div: int, quant_x: bool = True, upcast: bool = False,
                     out_dtype: torch.dtype | None = None,
                     config: dict | None = None) -> torch.Tensor:
    """``y = x @ W^T`` for block-FP8 ``W`` (see the module docstring).

    Args:
        x: [M, K] bf16/fp16/fp32 (unit column stride), M >= 1.
        wq: [N, K] float8_e4m3fn, row-major.
        scale: [R, ceil(K/block_k)] fp32 weight scales, scale row ``n // row_div`` for
            weight row ``n`` (``row_div`` = bn, or 1 for one row of scales per weight row).
        block_k: the scales' K block (a power of two >= 16; the kernel's ``BLOCK_K``).
        quant_x: W8A8 (x quantized per token per ``block_k`` columns by
            :func:`quantize_act_groups_triton`); False: weight-only.
        upcast: W8A8 with the e4m3 tiles upcast to fp16 for ``tl.dot`` (GPUs without FP8
            tensor cores, the interpreter); the same products as the FP8 dot, accumulated
            exactly in fp32. Always taken for a float32 ``x``.
        out_dtype: default x's dtype.
        config: launch parameters (:func:`block_gemm_config`'s keys); default from it.
    Returns:
        [M, N] in ``out_dtype``, fp32 accumulation; split K sums its parts in a fixed order.
    Raises:
        ValueError: a ``scale`` whose column count is not ``ceil(K / block_k)``.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = wq.shape[0]
    if scale.shape[1] != triton.cdiv(k, block_k):
        raise ValueError(f"block-FP8 scales {tuple(scale.shape)} do not cover K = {k} in "
                         f"blocks of {block_k}")
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    cfg = dict(config or block_gemm_config(m, n, k, block_k, not quant_x, x.device.type))
    split = cfg.setdefault("SPLIT_K", 1)
    m_blocks = triton.cdiv(m, cfg["BLOCK_M"])
    n_blocks, k_per_split, part, locks = split_k_launch(y, k, split, cfg["BLOCK_N"], block_k,
                                                        m_blocks)
    if quant_x:
        # float32 activations take the exact fp16-upcast dot: Hopper's e4m3 MMA accumulates
        # in reduced precision (on the H200, 2026-12-04, a float32 model's W8A8 log-probs
        # moved 4.0e-2 from the exact reference with it, 1.6e-2 with Triton's
        # max_num_imprecise_acc=32); bf16/fp16 keep the FP8 tensor cores
        upcast = upcast or x.dtype == torch.float32
        a, sa = quantize_act_groups_triton(x, block_k)
    else:
        a, sa = x, scale   # sa unused
    _fp8_block_gemm_kernel[(n_blocks, split, m_blocks)](
        a, sa, wq, scale, y, part, locks, m, n, k, k_per_split, row_div,
        a.stride(0), sa.stride(0), wq.stride(0), scale.stride(0), y.stride(0),
        A_FP8=quant_x, UPCAST=upcast, IEEE=(not quant_x and x.dtype == torch.float32),
        BLOCK_K=block_k, **cfg)
    return y
