"""LoRA on the linear layers: per-layer adapter slots and the per-step batch they read.

A layer with adapters gets a :class:`LoRASlots` as its ``lora`` attribute
(``engine.layers.linear.LinearBase``): stacked buffers with one slot per adapter that the
step may use (``--max-loras-per-batch`` slots, rank ``--max-lora-rank`` each), so a graph
captured once serves any adapter mix:

    a      [P, S, R, K_rank] float, the model dtype: part p's ``lora_A`` rows [0, r)
                             (in memory [S, P, R, K_rank] on the torch path, below)
    b      [S, R, N_rank]    ``lora_B`` transposed, times the adapter's scale, rows [0, r),
                             the parts' columns side by side as in the layer's output

A fused projection has P parts (q/k/v: 3, gate/up: 2, others 1); a slot of an adapter
without some module keeps zeros there. Tensor parallelism follows the base layer (Megatron
split, as SGLang and vLLM do): a column-parallel layer keeps A whole and this rank's rows of
B; a row-parallel layer keeps this rank's columns of A and B whole, so its delta is a partial
sum that the layer's all-reduce adds up with the base output.

All the layers of a model share one :class:`LoRABatch`, which the model runner fills before
each step (segments: one per request, with its slot, -1 for the base model). The delta runs
through ``kernels.lora.lora_triton`` (Triton) on an accelerator and through the torch path
(``kernels.lora.reference``) on the CPU. For the torch path the batch works out once per step
which slots the step uses (a range ``[first, first + U)``) and each row's mask over them, and
the slots keep ``a`` slot-major in memory (``[S, P, R, K]``, seen as ``[P, S, R, K]``) with
2-D views of each slot range cached, so a projection's delta is 1 + 2P ops over the U slots'
bytes only.
"""

from __future__ import annotations

import torch

from kernels.lora.reference import lora_apply_slots


class LoRABatch:
    """One step's adapter rows, read by every :class:`LoRASlots` of the model.

    Attributes:
        active: False when no row of the step uses an adapter (the layers skip LoRA).
        seg_start, seg_len, seg_slot: [G] int32 device tensors (Triton path).
        max_len: the longest segment in tokens (host int).
        first_slot, num_used: the torch path's slot range ``[first_slot, first_slot +
            num_used)``: every slot the step's rows use lies in it.
        mask: [T, num_used, 1] in the model dtype, 1 at each row's slot in the range (a zero
            row for base rows), or None when every row uses the one slot (torch path).
        use_triton: run the Triton kernels (accelerators) or the torch path (CPU).
    """

    def __init__(self, use_triton: bool, num_slots: int, dtype: torch.dtype):
        self.use_triton = use_triton
        self.num_slots = num_slots
        self.dtype = dtype
        self.active = False
        self.seg_start = self.seg_len = self.seg_slot = None
        self.max_len = 0
        self.first_slot = self.num_used = 0
        self.mask: torch.Tensor | None = None

    def set_segments(self, starts: list[int], lens: list[int], slots: list[int],
                     device: torch.device, seg_tensors=None) -> None:
        """Describe a step: request i's ``lens[i]`` rows from ``starts[i]`` use ``slots[i]``.

        ``seg_tensors``: the three [G] int32 tensors already on the device (the runner
        copies them with the step's other arrays), else they are made here when needed.
        """
        self.active = any(s >= 0 for s in slots)
        if not self.active:
            return
        if self.use_triton:
            if seg_tensors is None:
                seg_tensors = torch.tensor([starts, lens, slots], dtype=torch.int32,
                                           device=device).unbind(0)
            self.seg_start, self.seg_len, self.seg_slot = seg_tensors
            self.max_len = max(lens)
            return
        used = [s for s in slots if s >= 0]
        first = min(used)
        self.first_slot, self.num_used = first, max(used) + 1 - first
        if len(used) == len(slots) and self.num_used == 1:
            self.mask = None  # every row on one slot: no mask
            return
        row_slot = torch.tensor([slot - first if slot >= 0 else self.num_used
                                 for n, slot in zip(lens, slots) for _ in range(n)])
        mask = torch.zeros(len(row_slot), self.num_used + 1, dtype=self.dtype)
        mask[torch.arange(len(row_slot)), row_slot] = 1  # base rows: the extra column
        self.mask = mask[:, :self.num_used].contiguous().view(-1, self.num_used, 1).to(device)

    def set_static(self, seg_start: torch.Tensor, seg_len: torch.Tensor,
                   seg_slot: torch.Tensor, max_len: int) -> None:
        """Point the layers at a decode graph's static buffers (captured; the runner fills
        ``seg_slot`` before each replay)."""
        self.active = True
        self.seg_start, self.seg_len, self.seg_slot, self.max_len = (
            seg_start, seg_len, seg_slot, max_len)


class LoRASlots:
    """The adapter slots of one linear layer.

    Args:
        parts: per part ``(column offset in the output, n_p rows on this rank, rank whose
            rows of the full lora_B this rank holds or None for all)``.
        in_features: K on this rank; ``in_shard``: ``(rank, K)`` when A is split by input
            columns (row-parallel), else None.
        num_slots, max_rank: S and R.
        batch: the model's shared :class:`LoRABatch`.
    """

    def __init__(self, parts: list[tuple[int, int, int | None]], in_features: int,
                 in_shard: tuple[int, int] | None, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, batch: LoRABatch):
        self.parts = parts
        self.cols = [(off, n) for off, n, _ in parts]
        self.in_shard = in_shard
        self.max_rank = max_rank
        self.batch = batch
        r = max_rank
        p_num = len(parts)
        if batch.use_triton:
            self.a = torch.zeros(p_num, num_slots, r, in_features, dtype=dtype, device=device)
        else:  # slot-major in memory (a slot range is one 2-D view), [P, S, R, K] in shape
            self.a = torch.zeros(num_slots, p_num, r, in_features, dtype=dtype,
                                 device=device).transpose(0, 1)
        self.b = torch.zeros(num_slots, r, sum(n for _, n, _ in parts), dtype=dtype,
                             device=device)
        #: torch path: ``(first slot, U) -> (A [U*P*R, K], [B_p [U*R, n_p]])`` views of the
        #: slot range (the buffers are only ever written in place, so views stay valid)
        self._views: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b))

    def clear_part(self, slot: int, part: int) -> None:
        """Zero one part of ``slot`` (an adapter without this projection)."""
        off, n = self.cols[part]
        self.a[part, slot].zero_()
        self.b[slot, :, off:off + n].zero_()

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Copy one part of an adapter into ``slot``.

        Args:
            a: [r, K_full] the full ``lora_A``; b: [N_full_part, r] the full ``lora_B`` with
                the scale folded in (any float dtype, any device). r <= R.
        """
        r = a.shape[0]
        if self.in_shard is not None:
            rank, k = self.in_shard
            a = a[:, rank * k:(rank + 1) * k]
        _, n, b_rank = self.parts[part]
        if b_rank is not None:
            b = b[b_rank * n:(b_rank + 1) * n]
        rows = self.a[part, slot]
        rows.zero_()
        rows[:r].copy_(a)
        off = self.cols[part][0]
        dst = self.b[slot, :, off:off + n]
        dst.zero_()
        dst[:r].copy_(b.t())

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y [T, N] += delta(x [T, K])`` for the rows of the step's adapters."""
        batch = self.batch
        if not batch.active:
            return y
        if batch.use_triton:
            from kernels.lora.lora_triton import lora_apply_triton

            return lora_apply_triton(x, y, self.a, self.b, self.cols, batch.seg_start,
                                     batch.seg_len, batch.seg_slot, batch.max_len)
        key = (batch.first_slot, batch.num_used)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = self._range_views(*key)
        return lora_apply_slots(x, y, views[0], views[1], self.cols, batch.mask)

    def _range_views(self, first: int, u: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        p_num, _, r, k = self.a.shape
        a2 = self.a.transpose(0, 1)[first:first + u].view(u * p_num * r, k)
        b2 = self.b[first:first + u].view(u * r, self.b.shape[2])
        return a2, [b2[:, off:off + n] for off, n in self.cols]
