"""The scheduler: continuous batching over a paged KV cache.

Each ``step()``: (1) build a batch — prefill/extend under the chunked-prefill token budget
when requests wait and KV pages allow, with the running decodes mixed in as 1-token extends,
else one decode step for every running request (preempting the newest ones, recompute-style,
when the pool cannot hold one more token each); (2) run the model and sample; (3) append
tokens, check stop conditions and free finished requests. The offline ``LLM``
(``engine/llm.py``) and the engine process (``engine/scheduler/engine_loop.py``) both drive
this same class.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from engine.args import ServerArgs, prefill_budget
from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import ForwardMode
from engine.kv.manager import KVCacheManager
from engine.scheduler.grammar_queue import COMPILE_BUDGET_S, GrammarQueue
from engine.scheduler.output import (
    STATS_TTFT_ZERO,
    OutputProcessorMixin,
    StepOutput,
    _InFlight,
)
from engine.scheduler.prefix_policy import PrefixPolicyMixin
from engine.scheduler.request import FinishReason, Req
from engine.speculative import create_proposer
from engine.speculative.worker import SpecWorker, VerifyBatch

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per step, back toward MIN after a preemption raised it
FUTURE_TOKENS_CLIP = 4096
PROMPT_LOGPROBS_CHUNK = 512  # prompt tokens per step for a request that wants their logprobs
LORA_MAX_DEFER_S = 0.5  # seconds a request may wait for an adapter slot (see _build_extend)


class Scheduler(PrefixPolicyMixin, OutputProcessorMixin):
    """Continuous-batching scheduler over a ``ModelRunner``.

    Args:
        runner: the ModelRunner (owns the model, ``req_to_token_pool`` and ``kv_pool``).
        tokenizer: used to find stop strings in the tail of the output (may be None).
        eos_ids: token ids that end generation unless ``ignore_eos``.
    """

    def __init__(self, args: ServerArgs, runner, tokenizer=None, eos_ids: list[int] | None = None):
        self.args = args
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_ids = sorted(set(eos_ids or []))
        self.req_pool = runner.req_to_token_pool
        self.kv_pool = runner.kv_pool
        self.page_size = self.kv_pool.page_size
        # KV pages, req_to_token rows and the radix prefix cache (engine/kv/manager.py)
        self.kv = KVCacheManager(self.kv_pool, self.req_pool,
                                 disable_cache=getattr(args, "disable_radix_cache", False))
        self.schedule_policy = getattr(args, "schedule_policy", "fcfs")
        # assert the KV page accounting after every step (tests; costs O(pool) per step)
        self.check_kv = False
        self.chunk_size = prefill_budget(args, getattr(runner, "device_type", "cpu"))
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # the request whose prefill is partly done
        # fraction of their remaining max_tokens that running requests are expected to still
        # generate; admission keeps that much KV free (the idea of SGLang's new_token_ratio)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        # constrained requests wait here until their grammar is compiled
        self.grammars = GrammarQueue(tokenizer, getattr(runner, "vocab_size", 0), self.eos_ids,
                                     getattr(args, "grammar_compile_timeout", COMPILE_BUDGET_S))
        self.pending_aborts: set[str] = set()
        self.finished_outputs: list[StepOutput] = []
        self.inflight: _InFlight | None = None
        # requests whose prompt an earlier extend step computed: their whole pages go into
        # the prefix cache when the next extend step is built
        self._prefilled: list[Req] = []
        # overlap host scheduling with device work; pointless on the CPU, where ops block
        self.overlap = (not args.disable_overlap_schedule
                        and getattr(runner, "supports_overlap", False))
        # prefix_cache_queries/hits: prompt tokens looked up in the radix cache at admission,
        # and those found (vLLM's counter pair)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0,
                      "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self.stats.update(STATS_TTFT_ZERO)
        # speculative decoding (--speculative-algorithm): verify steps replace small decodes
        proposer = create_proposer(args, runner, tokenizer) \
            if getattr(args, "speculative_algorithm", None) else None
        self.spec = SpecWorker(args, proposer, self.kv, runner, self.stats) if proposer \
            else None
        self.lora_served = getattr(runner, "lora", None) is not None  # adapter slots to fill

    # ---- queue --------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        if req.lora_id is not None:  # the adapter stays loaded until the request ends
            self.runner.lora.acquire(req.lora_id)
        self.reqs[req.rid] = req
        if not self.grammars.add(req):
            self.waiting.append(req)

    def abort_request(self, rid: str, message: str | None = None) -> None:
        """Drop a request at the next step (frees its KV). Unknown rids are ignored."""
        if rid in self.reqs:
            self.pending_aborts.add(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.pending_aborts
                    or self.finished_outputs or self.inflight or self.grammars)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- KV bookkeeping -----------------------------------------------------------------
    def _grow(self, req: Req, n: int) -> list[int] | None:
        """Allocate slots for ``n`` more tokens of ``req``; None (nothing taken) if no room."""
        return self.kv.grow(req, n)

    def _free_tokens(self) -> int:
        """KV tokens that can be allocated: free pages plus evictable prefix-cache pages."""
        return self.kv.available_tokens()

    def _finish(self, req: Req, reason: FinishReason, cache: bool = True) -> None:
        req.finished_reason = reason
        self.kv.release(req, cache)
        if self.reqs.pop(req.rid, None) is not None and req.lora_id is not None:
            self.runner.lora.release(req.lora_id)

    def _process_aborts(self) -> None:
        if not self.pending_aborts:
            return
        for rid in list(self.pending_aborts):
            req = self.reqs.get(rid)
            if req is not None and not req.finished:
                self._abort_now(req, "aborted")
        self.pending_aborts.clear()

    @staticmethod
    def _future_tokens(req: Req) -> int:
        """Tokens ``req`` may still generate, clipped (a max_tokens of the whole context
        would otherwise block admission for requests that mostly stop early)."""
        return min(req.max_new_tokens - len(req.output_ids), FUTURE_TOKENS_CLIP)

    def _preempt(self, req: Req) -> None:
        # after a preemption admit more cautiously; the ratio decays back each step
        self.new_token_ratio = 1.0
        self.kv.release(req)  # its computed pages go to the prefix cache: readmission hits
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1
        logger.debug("preempted %s (KV pool full)", req.rid)

    def _decode_reserve(self) -> int:
        """KV tokens (whole pages) the running requests' next tokens need: a page for each
        request whose last page is full, nothing for one with room left in it."""
        pool = self.kv_pool
        pages = sum(pool.pages_needed(r.kv_len, len(r.pages), 1) for r in self.running)
        return pages * self.page_size

    def _retract(self) -> None:
        """Free KV until every running request can take one more token: preempt the newest
        running requests first, then the partly prefilled one, the oldest running request
        last, so it always progresses (it fits alone: no request outgrows the pool)."""
        if self._free_tokens() < self._decode_reserve():
            # a preempted request is recomputed from its ids: they must be real ones, and
            # the in-flight step may finish (and free) some requests
            self._drain()
        while self._free_tokens() < self._decode_reserve():
            if len(self.running) > 1 or (self.running and self.chunked is None):
                self._preempt(self.running.pop())
            elif self.chunked is not None:
                self._preempt(self.chunked)
                self.chunked = None
            else:
                return

    def _build_extend(self) -> ScheduleBatch | None:
        """Continue the chunked request, admit waiting ones under the chunk budget, and mix
        in the running decodes as 1-token extends."""
        budget = self.chunk_size
        # keep the pages free that the running requests' next decode tokens need
        reserve = self._decode_reserve()
        # and room for the tokens the admitted requests are still expected to generate
        future = self.new_token_ratio * sum(self._future_tokens(r) for r in self.running)
        reqs, prefix, ext, sample, locs = [], [], [], [], []
        max_running = self.args.max_running_requests
        # what earlier steps prefilled (whole prompts and the chunked request's chunks) goes
        # into the prefix cache now, so requests admitted below with the same prefix hit it
        for r in self._prefilled:
            if not r.finished and r.req_pool_idx is not None:
                self.kv.cache_unfinished(r)
        self._prefilled = []
        # requests being prefilled, by their first IN_BATCH_PREFIX tokens
        heads: dict[tuple, list[Req]] = {}
        if self.chunked is not None and (h := self._head(self.chunked)) is not None:
            heads[h] = [self.chunked]
        deferred: list[Req] = []
        # LoRA: the adapters of the running requests and of those admitted below; a step
        # holds at most --max-loras-per-batch of them
        adapters = {r.lora_id for r in self.running if r.lora_id is not None}
        if self.chunked is not None and self.chunked.lora_id is not None:
            adapters.add(self.chunked.lora_id)
        max_adapters = getattr(self.args, "max_loras_per_batch", 0)
        # adapters kept out > LORA_MAX_DEFER_S hold back requests taking/keeping a full batch's slot
        old = time.time() - LORA_MAX_DEFER_S
        starved = {r.lora_id for r in self.waiting if r.lora_id is not None and r.lora_id not in
                   adapters and r.recv_time < old} if self.lora_served else set()
        while budget > 0:
            if self.chunked is not None:
                req = self.chunked
            elif self.waiting:
                req = self.waiting[0]
                if len(self.running) + len(reqs) >= max_running or self.req_pool.available() == 0:
                    break
                if (req.lora_id is not None and req.lora_id not in adapters
                        and len(adapters) >= max_adapters):
                    deferred.append(self.waiting.popleft())  # its adapter has no slot now
                    continue
                if starved and req.lora_id is not None and req.lora_id not in starved and (
                        req.lora_id not in adapters or len(adapters) >= max_adapters):
                    deferred.append(self.waiting.popleft())  # behind a starved adapter
                    continue
                head = self._head(req)
                if head in heads and self._wait_for_twin(req, heads[head]):
                    deferred.append(self.waiting.popleft())
                    continue
                if head is not None:
                    heads.setdefault(head, []).append(req)
                self._admit_prefix(req)
                # a new request must fit with everything it and the others will still need;
                # alone it is always admitted (no request outgrows the pool)
                own = req.seq_len - req.kv_len + self.new_token_ratio * self._future_tokens(req)
                if (self.running or reqs) and self._free_tokens() - reserve < own + future:
                    self.kv.unmatch(req)
                    break
                future += self.new_token_ratio * self._future_tokens(req)
            else:
                break
            n = min(req.seq_len - req.kv_len, budget)
            if req.wants_prompt_logprobs:
                # every row of its chunk comes back as fp32 logits [n, vocab]: keep n small
                n = min(n, PROMPT_LOGPROBS_CHUNK)
            # what fits: the free slots of its last page plus the pages beyond the reserve
            room = len(req.pages) * self.page_size - req.kv_len \
                + self._free_tokens() - reserve
            if room < n:
                n = room
                if n <= 0:
                    if req is not self.chunked:
                        self.kv.unmatch(req)
                    break
            if req.req_pool_idx is None:
                req.req_pool_idx = self.req_pool.alloc()
                self.kv.write_prefix(req)
            if req.lora_id is not None:
                adapters.add(req.lora_id)
                starved.discard(req.lora_id)  # it has its slot
            if req is not self.chunked:
                self.waiting.popleft()
                self._count_lookup(req)
                if req.scheduled_time is None:  # not again after a preemption
                    req.scheduled_time = time.time()
            start = req.kv_len
            locs.extend(self._grow(req, n))
            req.kv_len = start + n
            reqs.append(req)
            prefix.append(start)
            ext.append(n)
            done = req.kv_len == req.seq_len
            sample.append(done)
            budget -= n
            self.chunked = None if done else req
            if not done:
                break  # the chunked request continues next step
        self.waiting.extendleft(reversed(deferred))
        if not reqs:
            return None
        self._prefilled = list(reqs)
        all_rows = [r.wants_prompt_logprobs for r in reqs]
        # the reserve above leaves room for one more token of every running request
        n = self._add_decodes(reqs, prefix, locs)
        ext += [1] * n
        sample += [True] * n
        all_rows += [False] * n
        return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix, ext, sample, locs,
                             all_rows if any(all_rows) else [], num_decodes=n)

    def _add_decodes(self, reqs: list[Req], prefix: list[int], locs: list[int]) -> int:
        """Append every running request that gets a KV slot as a one-token step."""
        # evict what the whole step needs at once (an eviction walks the tree)
        self.kv.make_room(sum(self.kv_pool.pages_needed(r.kv_len, len(r.pages), 1)
                              for r in self.running))
        n = 0
        for req in self.running:
            slots = self._grow(req, 1)
            if slots is None:
                continue
            reqs.append(req)
            prefix.append(req.kv_len)
            locs.extend(slots)
            req.kv_len += 1
            n += 1
        return n

    def _build_decode(self) -> ScheduleBatch | None:
        if not self.running:
            return None
        self._retract()
        reqs, prefix, locs = [], [], []
        self._add_decodes(reqs, prefix, locs)
        if not reqs:
            return None
        return ScheduleBatch(ForwardMode.DECODE, reqs, prefix, [1] * len(reqs),
                             [True] * len(reqs), locs)

    def get_next_batch(self) -> ScheduleBatch | None:
        self._process_aborts()
        self.grammars.release(self)
        self._order_waiting()
        batch = self._build_extend() if (self.waiting or self.chunked) else None
        if batch is None and self.spec is not None and self.spec.wants(self.running):
            batch = self._build_verify()
        return batch if batch is not None else self._build_decode()

    def _build_verify(self) -> VerifyBatch | None:
        """A speculative decode step (``engine/speculative/worker.py``), or None when no
        request has a draft (then a plain decode runs)."""
        self._drain()  # drafts and positions need every real id
        if not self.running:
            return None
        self._retract()
        return self.spec.build(self.running) if self.running else None

    # ---- run + results ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one scheduler step; returns outputs of requests that produced tokens or ended.

        With overlap on, step N+1 is launched before step N's sampled ids are read back: the
        requests of step N carry placeholder ids (``-(k + 1)``, row k of step N's sampled-id
        tensor) that the model runner resolves on the device. Anything that needs real ids
        first drains the in-flight step: preemption before it builds the batch; grammars and
        penalties after step N+1's forward is launched and before it is sampled (SGLang's
        order), so a constrained batch keeps the overlap.
        """
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        batch = self.get_next_batch()
        if isinstance(batch, VerifyBatch):
            self._run_verify(batch)
        elif batch is None:
            self._drain()
        else:
            rec = self._launch(batch)
            prev, self.inflight = self.inflight, rec
            if prev is not None:
                self._process(prev)
            if not self.overlap:
                self._drain()
        outs, self.finished_outputs = self.finished_outputs, []
        if self.check_kv:
            self.kv.check(self.reqs.values())
        return outs

    def _drain(self) -> None:
        """Read back and process the in-flight step, if any."""
        if self.inflight is not None:
            rec, self.inflight = self.inflight, None
            self._process(rec)

    def _launch(self, batch: ScheduleBatch) -> _InFlight | None:
        sample_rows = [i for i, s in enumerate(batch.sample) if s]
        reqs = [batch.reqs[i] for i in sample_rows]
        needs_ids = self.inflight is not None and any(_needs_output_ids(r) for r in reqs)
        future = self.inflight.result.ids_dev if self.inflight is not None else None
        try:
            logits = self.runner.forward(batch, future)
            if self.spec is not None:  # an EAGLE head keeps the hidden states of the step
                self.spec.proposer.observe(batch)
            if needs_ids:
                # while this forward runs: read the in-flight step back, so the grammars
                # accept its tokens (this step's masks follow from them) and penalties see
                # real ids; a request that finished there keeps its row, unused
                self._drain()
            if batch.all_rows:
                rows = batch.logits_rows()
                self._prompt_logprobs(batch, logits, rows)
                logits = logits[[rows[i][0] + rows[i][1] - 1 for i in sample_rows]]
            elif len(sample_rows) != batch.batch_size:
                logits = logits[sample_rows]
            result = self.runner.sample(logits, reqs, self.eos_ids) if reqs else None
        except Exception as exc:  # a bug or a device error: fail this batch, keep serving
            if getattr(getattr(self.runner, "tp", None), "size", 1) > 1:
                raise  # the other ranks may be inside this step's collectives: stop them all
            logger.exception("step failed; aborting %d requests", batch.batch_size)
            self._drain()
            for req in batch.reqs:
                if not req.finished:
                    self._abort_now(req, f"internal error: {exc}", cache=False)
            return None
        self.stats["steps"] += 1
        n_prompt = 0
        for i, req in enumerate(batch.reqs):
            end = min(batch.prefix_lens[i] + batch.extend_lens[i], len(req.origin_input_ids))
            start = max(batch.prefix_lens[i], req.prompt_counted)
            if end > start:
                n_prompt += end - start
                req.prompt_counted = end
        self.stats["prompt_tokens"] += n_prompt
        slots = []
        running = {id(r) for r in self.running}
        for k, req in enumerate(reqs):
            if req.finished:  # ended in the step read back above
                continue
            req.output_ids.append(-(k + 1))
            slots.append((req, len(req.output_ids) - 1, k))
            if id(req) not in running:
                self.running.append(req)
        return _InFlight(result, slots) if slots else None

    def _abort_now(self, req: Req, message: str, cache: bool = True) -> None:
        """End ``req`` now; ``cache=False`` keeps its KV out of the prefix cache (a failed
        step may have left it wrong)."""
        if req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        while req.output_ids and req.output_ids[-1] < 0:
            req.output_ids.pop()
        self._finish(req, FinishReason("abort", message=message), cache)
        self.finished_outputs.append(StepOutput(req, [], req.finished_reason))

def _needs_output_ids(req: Req) -> bool:
    sp = req.sampling_params
    # a grammar's mask for this step needs the previous token accepted into its matcher
    return (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
            or sp.repetition_penalty != 1.0 or req.grammar is not None)
