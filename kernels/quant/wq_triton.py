"""Triton GEMM over weight-only low-bit layouts (:mod:`kernels.quant.quant_ref`'s q4 and q8).

``wq_linear(x [M, K], fmt, qweight, scales, mins) -> [M, N]`` in x's dtype (W4A16 / W8A16
with fp16 or bf16 activations; fp32 activations multiply in IEEE fp32). One program computes
a ``BLOCK_M x BLOCK_N`` tile of the output: for each ``BLOCK_K`` slice of K it loads the
packed bytes of ``BLOCK_N`` weight rows, unpacks them in registers (a q4 element ``e`` of a
row sits in byte ``e // 32 * 16 + e % 16``, low nibble for ``e % 32 < 16``, high nibble
otherwise), applies the per-group scale (and min), and accumulates ``tl.dot`` in fp32. The
same code path runs on CUDA and XPU; the tests run it in the interpreter against
:func:`kernels.quant.quant_ref.wq_matmul_ref`.

Not done yet: split-K for small M (the FP8 small-M kernel's scheme) and tuned tile tables;
the tiles below are a fixed heuristic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _wq_kernel(x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr, M, N, K, G, stride_xm, stride_ym,
               Q4: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    ng = K // G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wmask = mask_n[:, None] & mask_k[None, :]
        if Q4:
            j = kk % 32
            byte = (kk // 32) * 16 + j % 16
            shift = (j // 16) * 4
            b = tl.load(qw_ptr + offs_n[:, None] * (K // 2) + byte[None, :], mask=wmask,
                        other=0).to(tl.int32)
            q = ((b >> shift[None, :]) & 0xF).to(tl.float32)
        else:
            q = tl.load(qw_ptr + offs_n[:, None] * K + kk[None, :], mask=wmask,
                        other=0).to(tl.float32)
        sidx = offs_n[:, None] * ng + (kk // G)[None, :]
        w = q * tl.load(s_ptr + sidx, mask=wmask, other=0.0).to(tl.float32)
        if Q4:
            w += tl.load(m_ptr + sidx, mask=wmask, other=0.0).to(tl.float32)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def wq_linear(x: torch.Tensor, fmt: str, qweight: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ W^T`` -> ``[M, N]`` in x's dtype, W in the ``q4``/``q8`` layout."""
    if fmt not in ("q4", "q8"):
        raise ValueError(f"unknown weight layout {fmt!r} (q4 or q8)")
    q4 = fmt == "q4"
    m, k = x.shape
    n = qweight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wq_kernel[grid](x, qweight, scales, mins if q4 else scales, y, m, n, k,
                     k // scales.shape[1], x.stride(0), y.stride(0), Q4=q4,
                     IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                     BLOCK_K=block_k)
    return y
