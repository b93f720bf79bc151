"""The torch path of batched LoRA (:mod:`kernels.lora`): the CPU's, and the tests' second
opinion. No Triton import, so the CPU engine needs no Triton."""

from __future__ import annotations

import torch


def lora_apply_torch(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                     parts: list[tuple[int, int]], rows_by_slot: list[tuple[int, torch.Tensor]]
                     ) -> torch.Tensor:
    """:func:`kernels.lora.lora_apply_triton` in torch: for each slot, its rows' shrink and expands.

    ``rows_by_slot``: ``(slot, row indices [n] int64)`` per adapter in the batch (base rows
    are in none). The delta is computed in x's dtype, as peft does.
    """
    for slot, rows in rows_by_slot:
        xs = x.index_select(0, rows)
        s = xs @ a[slot].t()
        for p, ((off, n), b) in enumerate(zip(parts, bs)):
            r = b.shape[2]
            delta = s[:, p * r:(p + 1) * r] @ b[slot].t()
            y[:, off:off + n].index_add_(0, rows, delta.to(y.dtype))
    return y
