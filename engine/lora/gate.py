"""``LoRAGate``: which adapters one extend step may bring in.

A step holds at most ``--max-loras-per-batch`` distinct adapters (the device slots of
``LoRAManager``). The gate starts from the adapters the step already has (its running
requests' and the partly prefilled request's) and answers, for each waiting request the
scheduler considers, whether its adapter may join:

- the cap: a request whose adapter is not in the step and would need a slot that is not
  free waits;
- the starvation hold: while some adapter has been kept out for more than
  ``LORA_MAX_DEFER_S`` (its oldest waiting request arrived that long ago), a request of
  another adapter that would take a new slot, or join a full step, waits too, so the running
  adapters drain and the starved one gets a slot (without it a steady stream for one
  adapter keeps another out for good).

It reads only ``lora_id`` (an int, or None for the base model) and ``recv_time`` (``time.time()``
seconds) of a request, so it works on any request object; the scheduler's admission
(``engine/scheduler/admission.py``) runs it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

#: seconds a request may wait for an adapter slot before its adapter holds others back
LORA_MAX_DEFER_S = 0.5


class LoRAGate:
    """One extend step's adapter admission.

    Args:
        max_adapters: the most distinct adapters a step may hold (``--max-loras-per-batch``).
        active: the adapter ids the step holds already (running and partly prefilled requests).
        starved: the adapter ids kept out past ``LORA_MAX_DEFER_S``.
    """

    def __init__(self, max_adapters: int, active: set[int], starved: set[int]):
        self.max_adapters = max_adapters
        self.active = active
        self.starved = starved

    @classmethod
    def for_step(cls, max_adapters: int, stepping: Iterable, waiting: Iterable,
                 served: bool, now: float | None = None) -> LoRAGate:
        """The gate of a step whose requests already in it are ``stepping`` (running and
        partly prefilled), with ``waiting`` queued; ``served``: whether the server has
        adapters at all (without, the starvation scan of the queue is skipped)."""
        active = {r.lora_id for r in stepping if r.lora_id is not None}
        starved: set[int] = set()
        if served:
            old = (time.time() if now is None else now) - LORA_MAX_DEFER_S
            starved = {r.lora_id for r in waiting if r.lora_id is not None
                       and r.lora_id not in active and r.recv_time < old}
        return cls(max_adapters, active, starved)

    def admits(self, lora_id: int | None) -> bool:
        """Whether a request of adapter ``lora_id`` (None: the base model) may join now."""
        if lora_id is None:
            return True
        new = lora_id not in self.active
        full = len(self.active) >= self.max_adapters
        if new and full:
            return False  # no slot for its adapter in this step
        # behind a starved adapter: no new slot, and no place in a full step
        return not (self.starved and lora_id not in self.starved and (new or full))

    def take(self, lora_id: int | None) -> None:
        """Record that a request of ``lora_id`` joined the step (its adapter has a slot)."""
        if lora_id is not None:
            self.active.add(lora_id)
            self.starved.discard(lora_id)
