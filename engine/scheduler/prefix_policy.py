"""``PrefixPolicy``: how the scheduler uses the radix prefix cache: which waiting request goes
first (``--schedule-policy lpm``), which waits a step for a twin's prefill to be cached, and
the hit accounting. ``Scheduler`` (``scheduler.py``) owns one; the step's admission
(``admission.py``) asks it about twins and counts hits through it. The cache itself is
``engine/kv/``.
"""

from __future__ import annotations

import time
from collections import deque

from engine.kv.manager import KVCacheManager
from engine.scheduler.request import Req

LPM_MAX_QUEUE = 128  # longer waiting queues are served FCFS (matching each would cost too much)
LPM_MAX_WAIT_S = 5.0  # a request waiting this long goes first under lpm (seconds)
# a waiting request that shares at least IN_BATCH_PREFIX more tokens with a request being
# prefilled (in this step, or in chunks) than the cache holds for it waits until that prefill
# is cached, then hits it (the idea of SGLang's in-batch prefix check); shorter shares are
# not worth a step
IN_BATCH_PREFIX = 32


class PrefixPolicy:
    """Prefix-cache decisions of the scheduler.

    Args:
        kv: the scheduler's ``KVCacheManager`` (the radix tree is ``kv.tree``).
        stats: the scheduler's stats dict; ``count_lookup`` adds to its
            ``prefix_cache_queries`` and ``prefix_cache_hits`` (prompt tokens).
        schedule_policy: ``--schedule-policy``, ``"fcfs"`` or ``"lpm"``.
    """

    def __init__(self, kv: KVCacheManager, stats: dict, schedule_policy: str = "fcfs"):
        self.kv = kv
        self.stats = stats
        self.schedule_policy = schedule_policy

    def count_lookup(self, req: Req) -> None:
        """Count a request's cache hit once it is really admitted (``req.kv_len`` is its
        matched prefix then); on its first admission only, so a preempted request that is
        looked up again is not counted twice."""
        if req.cached_tokens is None:
            n_prompt = len(req.origin_input_ids)
            req.cached_tokens = min(req.kv_len, n_prompt)
            if self.kv.enabled:
                self.stats["prefix_cache_queries"] += n_prompt
                self.stats["prefix_cache_hits"] += req.cached_tokens

    def order(self, waiting: deque[Req]) -> deque[Req]:
        """The waiting queue in the order admission takes it. ``--schedule-policy lpm``:
        longest cached prefix first (SGLang's policy), stable among equals; FCFS (``waiting``
        itself) when the queue is longer than ``LPM_MAX_QUEUE``. A request that has waited
        ``LPM_MAX_WAIT_S`` goes first whatever its prefix (no starvation while requests with
        cached prefixes keep arriving)."""
        if (self.schedule_policy != "lpm" or not self.kv.enabled
                or not 1 < len(waiting) <= LPM_MAX_QUEUE or self.kv.tree.total_pages == 0):
            return waiting
        now = time.time()
        keyed = [(0 if now - r.recv_time >= LPM_MAX_WAIT_S else 1,
                  -self.kv.prefix_len(r), i, r) for i, r in enumerate(waiting)]
        keyed.sort(key=lambda x: x[:3])
        return deque(x[3] for x in keyed)

    # ---- batch building -----------------------------------------------------------------
    def wait_for_twin(self, req: Req, twins: list[Req]) -> bool:
        """Whether ``req`` should wait: one of ``twins`` (being prefilled) shares at least
        ``IN_BATCH_PREFIX`` more of its prompt than the cache holds now."""
        want = req.key_tokens(0, req.seq_len - 1)
        cached = self.kv.prefix_len(req)
        return any(_common_prefix(want, t.key_tokens(0, t.seq_len)) - cached >= IN_BATCH_PREFIX
                   for t in twins)

    def head(self, req: Req) -> tuple | None:
        """The first ``IN_BATCH_PREFIX`` tokens of a request that could share them (the cache
        is on and its prompt is longer), else None; keyed by its LoRA adapter too (only
        requests of one adapter share KV)."""
        if not self.kv.enabled or req.seq_len <= IN_BATCH_PREFIX \
                or req.prompt_logprobs is not None:
            return None
        return (req.lora_id, *req.key_tokens(0, IN_BATCH_PREFIX))


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (binary search over slice equality,
    so each comparison runs in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
