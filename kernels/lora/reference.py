"""The torch reference of batched LoRA (:mod:`kernels.lora.lora_triton`): the CPU's path, and
the tests' second opinion. No Triton import, so the CPU engine needs no Triton.

Instead of one matmul pair per adapter (a dozen small ops per slot and projection, which the
CPU pays for in dispatch), every row is multiplied with every slot of the step's slot range
``[first, first + U)`` at once and a row x slot mask keeps each row's own slot: one shrink
GEMM ``x [T, K] @ A [U*P*R, K]^T``, and per part one mask multiply (which also makes the
part's ``[T, U*R]`` operand contiguous) and one expand GEMM ``[T, U*R] @ B [U*R, n]`` added
in place. That is U times the LoRA FLOPs (small next to the base GEMM while U*R << K) for a
fixed 1 + 2P ops; the bytes read are those of the U slots only (a decode step is
memory-bound: bs1 on one adapter reads one slot, not all S). When every row uses one slot
there is no mask at all (1 + P ops).

The fast core, :func:`lora_apply_slots`, takes the slot range as 2-D views: that needs the
slots stored slot-major (``A`` as ``[S, P, R, K]`` in memory), which is how
``engine.layers.lora.LoRASlots`` keeps them on the CPU. :func:`lora_apply_torch` takes any
layout (the Triton one, ``[P, S, R, K]``, is copied for the call).
"""

from __future__ import annotations

import torch


def lora_apply_slots(x: torch.Tensor, y: torch.Tensor, a2: torch.Tensor,
                     b_parts: list[torch.Tensor], parts: list[tuple[int, int]],
                     mask: torch.Tensor | None) -> torch.Tensor:
    """``y += delta(x)`` for U consecutive slots given as 2-D matrices, in place.

    Args:
        x: [T, K]; y: [T, N_total] (x's dtype).
        a2: [U*P*R, K] (row stride K): the U slots' lora_A rows, slot-major then part then
            rank row (slot u, part p, rank row i at row ``(u*P + p)*R + i``).
        b_parts: P matrices [U*R, n_p] (any row stride, unit column stride): part p's
            lora_B transposed (scale folded in) of the U slots, slot-major.
        parts: P ``(column offset, n_p)`` of each part in y.
        mask: [T, U, 1] in x's dtype, 1 where the row uses slot u (a zero row for base-model
            rows), or None when U == 1 and every row uses that slot.
    Returns:
        y.
    """
    t = x.shape[0]
    p_num = len(parts)
    u = 1 if mask is None else mask.shape[1]
    r = a2.shape[0] // (u * p_num)
    s = torch.mm(x, a2.t())  # [T, U*P*R]
    if mask is None:
        if p_num == 1:
            return y.addmm_(s, b_parts[0])
        for p, (off, n) in enumerate(parts):  # s's column slice is a strided 2-D matrix
            y[:, off:off + n].addmm_(s[:, p * r:(p + 1) * r], b_parts[p])
        return y
    if p_num == 1:
        return y.addmm_(s.view(t, u, r).mul_(mask).view(t, u * r), b_parts[0])
    s3 = s.view(t, u, p_num * r)
    for p, (off, n) in enumerate(parts):
        sp = torch.mul(s3[:, :, p * r:(p + 1) * r], mask)  # masked, contiguous [T, U, R]
        y[:, off:off + n].addmm_(sp.view(t, u * r), b_parts[p])
    return y


def lora_apply_torch(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     parts: list[tuple[int, int]], onehot: torch.Tensor | None,
                     first_slot: int = 0) -> torch.Tensor:
    """:func:`kernels.lora.lora_triton.lora_apply_triton` in torch, added to ``y`` in place.

    Args:
        x: [T, K]; y: [T, N_total].
        a: [P, S, R, K] stacked lora_A of the P parts (any strides; no copy when stored
            slot-major, i.e. ``a.transpose(0, 1)`` is contiguous).
        b: [S, R, N_total] stacked lora_B transposed, the parts' columns side by side (scale
            folded in, contiguous).
        parts: P ``(column offset, n_p)`` of each part in y.
        onehot: [T, U] in x's dtype: 1 at each row's slot among slots ``first_slot`` ..
            ``first_slot + U - 1``, a zero row for base rows; or None: every row uses
            ``first_slot``.
        first_slot: the first slot ``onehot``'s columns stand for.
    Returns:
        y.
    """
    p_num, _, r, k = a.shape
    u = 1 if onehot is None else onehot.shape[1]
    rng = slice(first_slot, first_slot + u)
    a2 = a[:, rng].transpose(0, 1).reshape(u * p_num * r, k)
    b2 = b[rng].reshape(u * r, b.shape[2])
    mask = None if onehot is None else onehot.reshape(x.shape[0], u, 1)
    return lora_apply_slots(x, y, a2, [b2[:, off:off + n] for off, n in parts], parts, mask)
