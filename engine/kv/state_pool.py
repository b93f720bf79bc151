"""The recurrent-state pool: fixed-size per-request states of linear-attention layers.

A layer whose :class:`engine.layer_spec.LayerSpec` has cache kind ``RECURRENT_STATE`` (a
Gated DeltaNet layer) keeps, per running request, one short-conv state and one recurrent
state, whatever the request's length. The pool holds them as one slot per request across all
such layers, sized at start-up (``--max-running-requests`` bounds the slots):

  conv_states[layer]      : [num_slots + 1, C, W - 1]     the last W - 1 conv inputs (dtype)
  recurrent_states[layer] : [num_slots + 1, Hv, K, V]     float32

Slot 0 is never handed out (a padded row of a batch points at it). A slot is zeroed when
allocated, so a fresh request starts from the zero state; the owner frees it on finish,
abort and preemption (a preempted request recomputes its prefix from zero).

With speculative decoding the pool has ``scratch`` more slots after the requests' ones
(``scratch_base`` on): a verify step of n tokens a request (its last token and its drafts)
runs each request's tokens from its slot, which it leaves as it is, and writes the state
after its row r of the step to scratch slot ``scratch_base + r``; once the drafts are
accepted, :meth:`RecurrentStatePool.commit` copies the state after each request's last
accepted token into its slot. This is what vLLM and SGLang do too (a state per draft
position); the alternative, re-running the accepted tokens from recorded inputs, was
ferry's first way and needs a second pass of small launches after every verify step.
Where every linear layer has the same shapes (Qwen3-Next, Qwen3.5) the layers' tensors are
views of one ``[layers, slots, ...]`` tensor each, so a commit is a few copies for all the
layers at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import device as dev
from engine.layer_spec import CacheKind, LayerSpec, RecurrentStateSpec, cache_groups

StateShape = RecurrentStateSpec  # one linear layer's per-request state shapes

#: the most bytes a commit gathers at once (the layers' copies go in groups under it)
COMMIT_TEMP_BYTES = 256 << 20


class RecurrentStatePool:
    """Per-request slots of (conv state, recurrent state) for each linear layer.

    Args:
        num_slots: requests that may hold a slot at once (>= 1).
        shapes: one :class:`engine.layer_spec.RecurrentStateSpec` per ``RECURRENT_STATE`` layer, in layer order.
        conv_dtype: dtype of the conv states (the model's); recurrent states are float32.
        device: where the tensors live.
        scratch: slots for a speculative verify step's per-row states (module docstring;
            0 without speculative decoding).
    Raises: ValueError when ``num_slots`` < 1.
    """

    def __init__(self, num_slots: int, shapes: Sequence[StateShape], conv_dtype: torch.dtype,
                 device: str | torch.device, scratch: int = 0):
        if num_slots < 1:
            raise ValueError(f"a recurrent-state pool needs at least one slot, not {num_slots}")
        self.num_slots, self.scratch = num_slots, scratch
        self.scratch_base = num_slots + 1
        self.shapes = tuple(shapes)
        total = num_slots + 1 + scratch
        conv = [(total, s.conv_dim, s.conv_width - 1) for s in self.shapes]
        rec = [(total, s.num_v_heads, s.k_head_dim, s.v_head_dim) for s in self.shapes]
        # one tensor per kind for all the layers where their shapes agree (a commit's copies)
        self._stacked = len(set(self.shapes)) == 1
        if self._stacked:
            self._conv_all = torch.zeros(len(conv), *conv[0], dtype=conv_dtype, device=device)
            self._rec_all = torch.zeros(len(rec), *rec[0], dtype=torch.float32, device=device)
            self.conv_states = list(self._conv_all.unbind(0))
            self.recurrent_states = list(self._rec_all.unbind(0))
        else:
            self.conv_states = [torch.zeros(c, dtype=conv_dtype, device=device) for c in conv]
            self.recurrent_states = [torch.zeros(r, dtype=torch.float32, device=device)
                                     for r in rec]
        self._free = list(range(num_slots, 0, -1))

    @staticmethod
    def bytes_per_slot(shapes: Sequence[StateShape], conv_dtype: torch.dtype) -> int:
        """Bytes one request's states take over all the linear layers."""
        conv = sum(s.conv_dim * (s.conv_width - 1) for s in shapes) * conv_dtype.itemsize
        rec = sum(s.num_v_heads * s.k_head_dim * s.v_head_dim for s in shapes) * 4
        return conv + rec

    @property
    def nbytes(self) -> int:
        """Device bytes of every slot's states (the padding and scratch slots included)."""
        return sum(t.numel() * t.element_size()
                   for t in (*self.conv_states, *self.recurrent_states))

    def available(self) -> int:
        """Slots free now."""
        return len(self._free)

    def alloc(self) -> int | None:
        """A zeroed slot (>= 1), or None when all are held."""
        if not self._free:
            return None
        slot = self._free.pop()
        for t in (*self.conv_states, *self.recurrent_states):
            t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back. Raises ValueError for slot 0, an unknown or a free slot."""
        if not 1 <= slot <= self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not held")
        self._free.append(slot)

    def commit(self, slots: Sequence[int], sources: Sequence[int]) -> None:
        """``states[slots[i]] = states[sources[i]]`` in every layer, conv and recurrent (a
        verify step's commit: ``sources`` are scratch slots). Raises ValueError: a target
        slot that is not a request's."""
        if not slots:
            return
        if any(not 1 <= s <= self.num_slots for s in slots):
            raise ValueError(f"commit into {list(slots)}: not request slots")
        idx = dev.host_to_device(torch.tensor([list(slots), list(sources)], dtype=torch.int64),
                                 self.conv_states[0].device)
        dst, src = idx[0], idx[1]
        if self._stacked:  # groups of layers, the gathered copy within COMMIT_TEMP_BYTES
            for t in (self._conv_all, self._rec_all):
                per = t[0, 0].numel() * t.element_size() * len(slots)
                step = max(1, COMMIT_TEMP_BYTES // per)
                for lo in range(0, t.shape[0], step):
                    t[lo:lo + step, dst] = t[lo:lo + step, src]
            return
        for t in (*self.conv_states, *self.recurrent_states):
            t[dst] = t[src]

    def memory_line(self) -> str:
        """The start-up log's line: slots and their size."""
        per = self.bytes_per_slot(self.shapes, self.conv_states[0].dtype if self.shapes
                                  else torch.float32)
        extra = (f" (+ {self.scratch} scratch slots for verify steps, "
                 f"{self.scratch * per / 2**30:.3f} GiB)" if self.scratch else "")
        return (f"recurrent state: {self.num_slots} slots x {len(self.shapes)} layers, "
                f"{per / 2**20:.2f} MiB/slot, {self.num_slots * per / 2**30:.3f} GiB{extra}")


def build_state_pool(specs: Sequence[LayerSpec], num_slots: int, conv_dtype: torch.dtype,
                     device: str | torch.device, scratch: int = 0,
                     ) -> tuple[RecurrentStatePool | None, dict[int, int]]:
    """The recurrent-state pool of a model's ``RECURRENT_STATE`` layers (this rank's specs),
    with ``scratch`` slots for speculative verify steps.

    Returns: ``(pool, index)``: ``index`` maps a layer id to its position in the pool's
    per-layer lists; ``(None, {})`` when no layer keeps a recurrent state.
    Raises: ValueError for a ``RECURRENT_STATE`` layer without its ``state`` shape.
    """
    layers = cache_groups(specs).get(CacheKind.RECURRENT_STATE, [])
    if not layers:
        return None, {}
    missing = [i for i in layers if specs[i].state is None]
    if missing:
        raise ValueError(f"layers {missing} keep a recurrent state without its shape "
                         "(LayerSpec.state)")
    pool = RecurrentStatePool(num_slots, [specs[i].state for i in layers], conv_dtype, device,
                              scratch)
    return pool, {layer: n for n, layer in enumerate(layers)}
