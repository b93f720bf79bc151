"""State snapshots: copies of a request's linear-attention states at a prefix boundary, kept
in the radix tree so that a later request with that prefix starts from them.

A hybrid model (Gated DeltaNet layers beside full-attention layers, ``engine/kv/state_pool.py``)
can reuse a cached prefix only where it also has the linear layers' conv and recurrent states
after exactly that prefix: the KV of the full-attention layers alone would skip them. The
scheduler copies a request's slot into a snapshot at chosen boundaries (the end of each
prefill chunk, and when the request ends; ``engine/kv/manager.py``), the radix tree
(``engine/kv/radix_cache.py``) keeps the snapshot on the node that ends at that boundary, and a
request whose match ends there copies it back into its own slot and prefills only the rest.

  conv[layer]      : [num_snapshots + 1, C, W - 1]   (the state pool's conv dtype)
  recurrent[layer] : [num_snapshots + 1, Hv, K, V]   float32

Index 0 is never handed out. Copies run on the device, in stream order with the steps, so a
snapshot taken after a step's forward was launched holds the states after that step.

Tensor parallelism: every rank holds a pool of its share of the states, with the same slot
count; rank 0 decides every copy. Its pool records the copies it makes between two steps
(``pending``: ``(TAKE, slot, snap)`` or ``(RESTORE, slot, snap)``, in order), which go to the
workers with the next step and run there before its forward (:meth:`apply`); the takes of a
step's prefill rows, made right after its forward is launched, travel with that step
(``ScheduleBatch.snap_takes``; ``engine/executor/tp_messages.py``).
"""

from __future__ import annotations

import torch

from engine import device as dev
from engine.kv.state_pool import RecurrentStatePool

#: share of the KV cache's memory the snapshots take by default (``--max-state-snapshots``)
DEFAULT_SNAPSHOT_SHARE = 0.1
#: at most this many snapshots per running request by default
MAX_SNAPSHOTS_PER_SLOT = 4
#: the kinds of a recorded copy: slot -> snapshot, snapshot -> slot
TAKE, RESTORE = 0, 1


class StateSnapshotPool:
    """Snapshot slots shaped like the slots of ``pool``.

    Args:
        pool: the recurrent-state pool whose slots are copied (its shapes and dtypes).
        num_snapshots: snapshot slots (>= 1).
    Raises: ValueError when ``num_snapshots`` < 1.
    """

    def __init__(self, pool: RecurrentStatePool, num_snapshots: int):
        if num_snapshots < 1:
            raise ValueError(f"a snapshot pool needs at least one slot, not {num_snapshots}")
        self.pool = pool
        self.num_snapshots = num_snapshots
        self.conv = [torch.empty((num_snapshots + 1, *t.shape[1:]), dtype=t.dtype,
                                 device=t.device) for t in pool.conv_states]
        self.recurrent = [torch.empty((num_snapshots + 1, *t.shape[1:]), dtype=t.dtype,
                                      device=t.device) for t in pool.recurrent_states]
        self._free = list(range(num_snapshots, 0, -1))
        #: rank 0 of a tensor-parallel group: the copies made since the last step was sent,
        #: ``(TAKE | RESTORE, slot, snap)`` in order (None: not recorded)
        self.pending: list[tuple[int, int, int]] | None = None

    @property
    def nbytes(self) -> int:
        """Device bytes of every snapshot slot (the unused index 0 included)."""
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.recurrent))

    @property
    def bytes_per_snapshot(self) -> int:
        return self.nbytes // (self.num_snapshots + 1)

    def available(self) -> int:
        """Snapshot slots free now."""
        return len(self._free)

    def alloc(self) -> int | None:
        """A free snapshot slot (>= 1, contents undefined), or None when all are held."""
        return self._free.pop() if self._free else None

    def free(self, snap: int) -> None:
        """Give ``snap`` back. Raises ValueError for 0, an unknown or a free slot."""
        if not 1 <= snap <= self.num_snapshots or snap in self._free:
            raise ValueError(f"state snapshot {snap} is not held")
        self._free.append(snap)

    def save(self, slot: int, snap: int) -> None:
        """Copy the state pool's ``slot`` (every linear layer) into snapshot ``snap``."""
        if self.pending is not None:
            self.pending.append((TAKE, slot, snap))
        self._save(slot, snap)

    def _save(self, slot: int, snap: int) -> None:
        for dst, src in zip((*self.conv, *self.recurrent),
                            (*self.pool.conv_states, *self.pool.recurrent_states)):
            dst[snap].copy_(src[slot])

    def save_many(self, slots: list[int], snaps: list[int], record: bool = True) -> None:
        """:meth:`save` of each ``(slots[i], snaps[i])``, in one gather and one scatter per
        state tensor (a step's prefill rows at once). ``record=False``: not added to
        ``pending`` (the copies travel with the step instead)."""
        if record and self.pending is not None:
            self.pending.extend((TAKE, a, b) for a, b in zip(slots, snaps))
        if len(slots) == 1:
            self._save(slots[0], snaps[0])
            return
        if not slots:
            return
        device = self.conv[0].device if self.conv else self.recurrent[0].device
        src = dev.host_to_device(torch.tensor(slots, dtype=torch.int64), device)
        dst = dev.host_to_device(torch.tensor(snaps, dtype=torch.int64), device)
        for d, s in zip((*self.conv, *self.recurrent),
                        (*self.pool.conv_states, *self.pool.recurrent_states)):
            d.index_copy_(0, dst, s.index_select(0, src))

    def restore(self, snap: int, slot: int) -> None:
        """Copy snapshot ``snap`` into the state pool's ``slot``."""
        if self.pending is not None:
            self.pending.append((RESTORE, slot, snap))
        for src, dst in zip((*self.conv, *self.recurrent),
                            (*self.pool.conv_states, *self.pool.recurrent_states)):
            dst[slot].copy_(src[snap])

    def take_pending(self) -> list[tuple[int, int, int]]:
        """Rank 0: the copies recorded since the last call (for the next step's message)."""
        if self.pending is None:
            return []
        ops, self.pending = self.pending, []
        return ops

    def apply(self, ops: list[tuple[int, int, int]]) -> None:
        """A worker: repeat rank 0's recorded copies ``(TAKE | RESTORE, slot, snap)`` in
        order. Raises ValueError on an unknown kind."""
        for kind, slot, snap in ops:
            if kind == TAKE:
                self._save(slot, snap)
            elif kind == RESTORE:
                self.restore(snap, slot)
            else:
                raise ValueError(f"unknown state snapshot copy {kind}")

    def memory_line(self) -> str:
        """The start-up log's line: snapshot slots and their size."""
        per = self.bytes_per_snapshot
        return (f"state snapshots (prefix cache): {self.num_snapshots} x "
                f"{per / 2**20:.2f} MiB, {self.num_snapshots * per / 2**30:.3f} GiB "
                f"(--max-state-snapshots)")


def default_snapshot_count(kv_bytes: float, bytes_per_snapshot: int, max_running: int) -> int:
    """Snapshots that take ``DEFAULT_SNAPSHOT_SHARE`` of ``kv_bytes`` (the KV cache's memory),
    at least 1 and at most ``MAX_SNAPSHOTS_PER_SLOT`` per running request."""
    n = int(DEFAULT_SNAPSHOT_SHARE * kv_bytes // max(bytes_per_snapshot, 1))
    return max(1, min(n, MAX_SNAPSHOTS_PER_SLOT * max_running))
