"""The torch path of batched LoRA (:mod:`kernels.lora`): the CPU's, and the tests' second
opinion. No Triton import, so the CPU engine needs no Triton.

Instead of one matmul pair per adapter (a dozen small ops per slot and projection, which the
CPU pays for in dispatch), every row is multiplied with every slot at once and a one-hot row
x slot mask keeps each row's own slot: one shrink GEMM ``x [T, K] @ A [P*S*R, K]^T``, the
mask, and per part one expand GEMM ``[T, S*R] @ B [S*R, n]`` added in place. That is S
times the LoRA FLOPs (small next to the base GEMM while S*R << K) for a fixed 2 + P ops.
"""

from __future__ import annotations

import torch


def lora_apply_torch(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     parts: list[tuple[int, int]], onehot: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.lora.lora_apply_triton` in torch, added to ``y`` in place.

    Args:
        x: [T, K]; y: [T, N_total].
        a: [P, S, R, K] stacked lora_A of the P parts (contiguous).
        b: [S, R, N_total] stacked lora_B transposed, the parts' columns side by side (scale
            folded in, contiguous).
        parts: P ``(column offset, n_p)`` of each part in y.
        onehot: [T, S] in x's dtype: 1 at each row's slot, a zero row for base rows.
    """
    t = x.shape[0]
    p_num, s_num, r, k = a.shape
    s = (x @ a.view(p_num * s_num * r, k).t()).view(t, p_num, s_num, r)
    s = s * onehot.view(t, 1, s_num, 1)
    b2 = b.view(s_num * r, b.shape[2])
    for p, (off, n) in enumerate(parts):
        y[:, off:off + n].addmm_(s[:, p].reshape(t, s_num * r), b2[:, off:off + n])
    return y
