"""``ExtendAdder``: the admission of one extend (prefill) step.

The scheduler makes one adder per extend step, hands it the partly prefilled request first
(if any) and then the waiting requests in queue order; :meth:`ExtendAdder.try_add` answers
each with an :class:`Admit`:

- ``ADD``: the request is in the step (its prefix matched and locked, a ``req_to_token`` row
  and KV slots for its chunk taken, its row appended to the step's lists);
- ``DEFER``: it stays in the queue, and admission goes on with the next one;
- ``STOP``: nothing more joins this step (it keeps its place at the head of the queue).

A waiting request passes these gates, in this order (the order matters: a deferred request
never locks a prefix, and a request that stops admission has its prefix unlocked again):

1. capacity: the step's requests stay under ``--max-running-requests``, a
   ``req_to_token`` row is free and (a model with linear-attention layers) a recurrent-state
   slot, else STOP (the request waits for one to be given back);
2. LoRA (``engine/lora/gate.py``): its adapter has a slot and no starved adapter waits
   ahead of it, else DEFER;
3. the twin wait (``PrefixPolicy``): a request being prefilled shares enough of its prompt
   that waiting a step for that prefill to be cached pays, else DEFER;
4. KV fit: with its cached prefix matched, its prompt and the tokens it and the running
   requests are still expected to generate (``new_token_ratio`` of their remaining
   ``max_tokens``) fit beside the running requests' next-token reserve, and (a windowed
   pool, ``engine/kv/windowed.py``) what it needs there at its peak fits beside theirs:
   a chunk and the window before the next chunk while more of its prompt follows, else
   its last chunk or its decodes' window, whichever is more (its window is all it keeps
   afterwards), else STOP (alone in the step it is always admitted: no request outgrows
   the pool);
5. the chunk: the rest of the token budget, at most ``PROMPT_LOGPROBS_CHUNK`` tokens for a
   request that wants its prompt's logprobs, and at most the KV room left; none left: STOP
   (never ending inside an image whose tokens attend to each other: Gemma 3's). A hybrid
   model's chunk may end earlier, where a state snapshot is wanted (a page boundary, the
   branching point of its match: ``engine/kv/manager.py``). The encoder budget: the
   images a chunk makes the vision tower encode (each whole, by the first chunk holding
   one of its tokens) cost their patches, and a step encodes at most ``encoder_budget``
   patches (``--max-prefill-tokens``, or the prefill budget if larger); the chunk that
   would pass it ends before that image (none of the request left: STOP), unless the
   step encodes nothing yet (one image over the budget is encoded alone).

The partly prefilled request passes only the last gate. A request whose chunk does not end
its prompt becomes the step's chunked request and closes the step.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from engine.kv.manager import KVCacheManager
from engine.kv.pool import ReqToTokenPool
from engine.lora.gate import LoRAGate
from engine.scheduler.prefix_policy import PrefixPolicy
from engine.scheduler.request import Req

FUTURE_TOKENS_CLIP = 4096
PROMPT_LOGPROBS_CHUNK = 512  # prompt tokens per step for a request that wants their logprobs


class Admit(enum.Enum):
    """What ``ExtendAdder.try_add`` did with a request."""

    ADD = "add"
    DEFER = "defer"
    STOP = "stop"


def future_tokens(req: Req) -> int:
    """Tokens ``req`` may still generate, clipped (a max_tokens of the whole context would
    otherwise block admission for requests that mostly stop early)."""
    return min(req.max_new_tokens - len(req.output_ids), FUTURE_TOKENS_CLIP)


class ExtendAdder:
    """One extend step's token budget, KV reserve and rows.

    Args:
        kv: the scheduler's KV manager (prefix matching, slots, the free-token count).
        req_pool: the ``req_to_token`` rows.
        prefix: the scheduler's ``PrefixPolicy`` (twins, hit accounting).
        lora: this step's ``LoRAGate``.
        running: the running (decoding) requests; they join the step later as 1-token rows.
        chunked: the partly prefilled request, or None.
        budget: prompt tokens the step may compute (``--chunked-prefill-size``).
        reserve: KV tokens kept free for the running requests' next tokens (whole pages).
        swa_reserve: windowed slots kept free for them (``KVCacheManager.swa_decode_reserve``:
            a request past its window gives a page back as it takes one; 0 without a
            windowed pool).
        max_running: ``--max-running-requests``.
        new_token_ratio: the share of their remaining ``max_tokens`` that requests are
            expected to still generate (admission keeps that much KV free).
        encoder_budget: image patches the step's vision-tower work may take (module
            docstring, gate 5); None: ``budget``.

    After admission, ``reqs``, ``prefix``, ``ext``, ``sample`` and ``locs`` are the step's
    rows (request, KV length before the step, tokens computed, whether it samples, the KV
    slots in row order), and ``chunked`` the request whose prefill continues next step.
    """

    def __init__(self, kv: KVCacheManager, req_pool: ReqToTokenPool, prefix: PrefixPolicy,
                 lora: LoRAGate, running: list[Req], chunked: Req | None, budget: int,
                 reserve: int, max_running: int, new_token_ratio: float,
                 swa_reserve: int = 0, encoder_budget: int | None = None):
        self.kv, self.req_pool, self.prefix, self.lora = kv, req_pool, prefix, lora
        self.running = running
        self.chunked = chunked
        self.budget = budget
        self.reserve = reserve
        self.swa_reserve = swa_reserve
        self.max_running = max_running
        self.ratio = new_token_ratio
        self.encoder_budget = budget if encoder_budget is None else encoder_budget
        #: image patches the step's admitted chunks make the vision tower encode
        self.encoded = 0
        # KV the running requests (and those admitted here) are still expected to generate
        self.future = new_token_ratio * sum(future_tokens(r) for r in running)
        self.stopped = False
        self.reqs: list[Req] = []
        self.prefix_lens: list[int] = []
        self.ext: list[int] = []
        self.sample: list[bool] = []
        self.locs: list[int] = []
        # requests being prefilled, by their first IN_BATCH_PREFIX tokens
        self.heads: dict[tuple, list[Req]] = {}
        if chunked is not None and (h := prefix.head(chunked)) is not None:
            self.heads[h] = [chunked]
        self._gates: tuple[Callable[[Req], Admit | None], ...] = (
            self._capacity, self._lora, self._twin, self._kv_fit)

    @property
    def open(self) -> bool:
        """Whether another waiting request may still join: budget left, admission not
        stopped, and no request left partly prefilled by this step."""
        return self.budget > 0 and not self.stopped and self.chunked is None

    def try_add(self, req: Req) -> Admit:
        """Run ``req`` (the chunked request, or the head of the waiting queue) through the
        gates; on ``ADD`` its row is in the step. The caller takes a waiting request out of
        its queue on ``ADD`` and ``DEFER``, and stops offering requests on ``STOP``."""
        if self.budget <= 0 or self.stopped:
            return self._stop()
        waiting = req is not self.chunked
        if waiting:
            for gate in self._gates:
                if (verdict := gate(req)) is not None:
                    return verdict
        n = self._chunk_len(req)
        if n <= 0:
            if waiting:
                self.kv.unmatch(req)
            return self._stop()
        self._add(req, n, waiting)
        return Admit.ADD

    def _stop(self) -> Admit:
        self.stopped = True
        return Admit.STOP

    # ---- the gates, in order (None: passed) ---------------------------------------------
    def _capacity(self, req: Req) -> Admit | None:
        if len(self.running) + len(self.reqs) >= self.max_running \
                or self.req_pool.available() == 0 or not self.kv.state_available():
            return self._stop()
        return None

    def _lora(self, req: Req) -> Admit | None:
        return None if self.lora.admits(req.lora_id) else Admit.DEFER

    def _twin(self, req: Req) -> Admit | None:
        head = self.prefix.head(req)
        if head is None:
            return None
        if head in self.heads and self.prefix.wait_for_twin(req, self.heads[head]):
            return Admit.DEFER
        self.heads.setdefault(head, []).append(req)
        return None

    def _kv_fit(self, req: Req) -> Admit | None:
        self.kv.match(req)  # its cached prefix, locked; unmatched again if it stops here
        # it must fit with everything it and the others will still need; alone it is always
        # admitted (no request outgrows the pool)
        own = req.seq_len - req.kv_len + self.ratio * future_tokens(req)
        if (self.running or self.reqs) and (
                self.kv.available_tokens() - self.reserve < own + self.future
                or self.kv.swa_available_tokens() - self.swa_reserve < self._swa_need(req)):
            self.kv.unmatch(req)
            return self._stop()
        self.future += self.ratio * future_tokens(req)
        return None

    def _swa_need(self, req: Req) -> int:
        """Windowed slots ``req`` takes at its peak (0 without a windowed pool): its first
        chunk n and the window W the next chunk reads while more of its prompt follows,
        else max(n, W + one page) (its decodes keep their window and the page being
        written; what falls behind the window goes back as it grows), plus a page of
        rounding."""
        if self.kv.swa_pool is None:
            return 0
        ps, w = self.kv.page_size, self.kv.swa_pool.window
        left = req.seq_len - req.kv_len
        n = min(left, self.budget)
        if req.wants_prompt_logprobs:  # as _chunk_len cuts it
            n = min(n, PROMPT_LOGPROBS_CHUNK)
        return (n + w if n < left else max(n, w + ps)) + ps

    def _chunk_len(self, req: Req) -> int:
        """Prompt tokens of ``req`` this step computes: the rest of its prompt within the
        budget (and ``PROMPT_LOGPROBS_CHUNK``: every row of its chunk comes back as fp32
        logits ``[n, vocab]``), within the KV room: the free slots of its last page plus the
        tokens beyond the reserves (``KVCacheManager.room``); with state snapshots (a hybrid model) cut where one is
        wanted (``KVCacheManager.chunk_len``). A chunk never ends inside an image of a
        bidirectional request (``MMInputs.image_cut``: Gemma 3's image tokens see each other)."""
        n = min(req.seq_len - req.kv_len, self.budget)
        if req.wants_prompt_logprobs:
            n = min(n, PROMPT_LOGPROBS_CHUNK)
        room = self.kv.room(req, self.reserve, self.swa_reserve)
        n = self.kv.chunk_len(req, min(n, room))
        if req.mm is not None and 0 < n < req.seq_len - req.kv_len:
            # a bidirectional image is prefilled in one chunk: cut before it, or (the chunk
            # starts in it) take it whole past the budget, if the KV room allows
            n = req.mm.image_cut(req.kv_len, req.kv_len + n) - req.kv_len
            if n > room:
                return 0
        if req.mm is not None and n > 0:
            n = self._encoder_cut(req, n)
        return n

    def _encoder_cut(self, req: Req, n: int) -> int:
        """The chunk ``[kv_len, kv_len + n)`` of image request ``req`` cut before the first
        image whose encoding would take the step past ``encoder_budget`` patches (the step
        already encoding something); 0 when that image starts at or before ``kv_len``."""
        start = req.kv_len
        used = self.encoded
        for i, it in enumerate(req.mm.items):
            if it.end <= start or i in req.mm.embeds:
                continue   # prefilled already, or encoded by an earlier chunk
            if it.offset >= start + n:
                break
            cost = it.pixel_values.shape[0]
            if used and used + cost > self.encoder_budget:
                return max(0, it.offset - start)
            used += cost
        return n

    def _encoder_cost(self, req: Req, n: int) -> int:
        """Image patches that the chunk ``[kv_len, kv_len + n)`` of ``req`` encodes."""
        if req.mm is None:
            return 0
        s = req.kv_len
        return sum(it.pixel_values.shape[0] for i, it in enumerate(req.mm.items)
                   if it.offset < s + n and it.end > s and i not in req.mm.embeds)

    # ---- commit -------------------------------------------------------------------------
    def _add(self, req: Req, n: int, waiting: bool) -> None:
        if req.req_pool_idx is None:
            req.req_pool_idx = self.req_pool.alloc()
            self.kv.write_prefix(req)
        self.kv.take_state(req)
        self.lora.take(req.lora_id)
        if waiting:
            self.prefix.count_lookup(req)
            if req.scheduled_time is None:  # not again after a preemption
                req.scheduled_time = time.time()
        start = req.kv_len
        self.encoded += self._encoder_cost(req, n)
        self.locs.extend(self.kv.grow(req, n))
        req.kv_len = start + n
        self.reqs.append(req)
        self.prefix_lens.append(start)
        self.ext.append(n)
        done = req.kv_len == req.seq_len
        self.sample.append(done)
        self.budget -= n
        # the chunked request continues next step
        self.chunked = None if done else req
