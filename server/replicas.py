"""Engine replicas behind the one front end (``--dp-size N``) and how a request picks one.

Each replica is an engine process (with its tensor-parallel ranks) and its own detokenizer,
on IPC paths of its own; the ``TokenizerManager`` keeps one PUSH and one PULL socket per
replica and remembers which replica each rid went to (its outputs come back on that
replica's socket; its abort goes there).

``Dispatcher`` picks the replica of a generation request from its token ids
(``--load-balance-method``):

- ``prefix_affinity`` (default): the prompt is cut into blocks of ``BLOCK`` tokens, each
  keyed by a hash of the whole prefix up to its end (so one key names one prefix). Each
  replica keeps the keys of the prompts recently sent to it (LRU, ``MAX_BLOCKS`` each): an
  approximate index of what its radix cache holds. The request goes to the replica with the
  longest run of leading keys, unless that replica is much busier than the least loaded one
  (more than ``--dp-balance-abs-threshold`` requests in flight beyond it *and* more than
  ``--dp-balance-rel-threshold`` times as many, sglang-router's rule for its cache-aware
  policy), or no replica holds its first block; then it goes to the least loaded one (ties:
  the lowest index). Either way its keys are recorded for the chosen replica.
- ``round_robin``: the next live replica in turn.
- ``shortest_queue``: the fewest requests in flight (ties: the lowest index).

A dead replica is skipped and its index dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

#: tokens per prefix block (a prompt shorter than one block has no affinity)
BLOCK = 16
#: prefix blocks remembered per replica (LRU), about 1M tokens of prompts
MAX_BLOCKS = 65536


def prefix_keys(ids: list[int], block: int = BLOCK) -> list[int]:
    """One key per whole block of ``ids``, each a hash of the prefix up to the block's end."""
    keys, h = [], 0
    for end in range(block, len(ids) + 1, block):
        h = hash((h, tuple(ids[end - block:end])))
        keys.append(h)
    return keys


@dataclass
class Replica:
    """One engine replica as the front end sees it."""

    index: int
    push: object                      # PushSocket to its engine
    pull: object = None               # AsyncPullSocket its engine and detokenizer push to
    ready: dict = field(default_factory=dict)   # child name -> ReadyOut
    dead: str | None = None           # why it is gone
    inflight: int = 0                 # its engine requests the server waits on
    info: object = None               # its last ServerInfoOut or StatsOut

    @property
    def alive(self) -> bool:
        return self.dead is None


class Dispatcher:
    """Chooses a replica per request (see the module docstring).

    Args:
        n: the number of replicas.
        method: ``prefix_affinity``, ``round_robin`` or ``shortest_queue``.
        abs_threshold, rel_threshold: the imbalance that overrides prefix affinity.
        max_blocks: prefix keys remembered per replica.
    """

    def __init__(self, n: int, method: str = "prefix_affinity", abs_threshold: int = 8,
                 rel_threshold: float = 1.5, max_blocks: int = MAX_BLOCKS,
                 block: int = BLOCK):
        self.method = method
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold
        self.max_blocks, self.block = max_blocks, block
        self.index: list[OrderedDict] = [OrderedDict() for _ in range(n)]
        self._next = 0

    def choose(self, ids: list[int], loads: list[int | None]) -> int:
        """The replica for a prompt of ``ids``; ``loads[i]``: replica i's requests in flight,
        None when it is dead. Records the prompt's prefix for the chosen one.

        Raises:
            LookupError: every replica is dead.
        """
        live = [i for i, x in enumerate(loads) if x is not None]
        if not live:
            raise LookupError("no live replica")
        least = min(live, key=lambda i: (loads[i], i))
        if self.method == "round_robin":
            n = len(loads)
            pick = next(i % n for i in range(self._next, self._next + n)
                        if loads[i % n] is not None)
            self._next = pick + 1
            return pick
        if self.method == "shortest_queue":
            return least
        keys = prefix_keys(ids, self.block)
        pick = least
        best = max(live, key=lambda i: (self.matched(i, keys), -loads[i], -i))
        if self.matched(best, keys) > 0 and not self._imbalanced(loads[best], loads[least]):
            pick = best
        self.record(pick, keys)
        return pick

    def _imbalanced(self, load: int, least: int) -> bool:
        return load - least > self.abs_threshold and load > least * self.rel_threshold

    def matched(self, i: int, keys: list[int]) -> int:
        """Leading blocks of ``keys`` in replica ``i``'s index."""
        idx, n = self.index[i], 0
        for k in keys:
            if k not in idx:
                break
            n += 1
        return n

    def record(self, i: int, keys: list[int]) -> None:
        idx = self.index[i]
        for k in keys:
            idx[k] = None
            idx.move_to_end(k)
        while len(idx) > self.max_blocks:
            idx.popitem(last=False)

    def forget(self, i: int) -> None:
        """Drop replica ``i``'s index (it died)."""
        self.index[i].clear()
