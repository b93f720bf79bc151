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
from collections import deque

from engine.args import ServerArgs, prefill_budget
from engine.executor.schedule_batch import ScheduleBatch
from engine.executor.step_runner import StepRunner
from engine.forward_batch import ForwardMode
from engine.kv.manager import KVCacheManager
from engine.layer_spec import CacheKind
from engine.lora.gate import LoRAGate
from engine.scheduler.admission import Admit, ExtendAdder
from engine.scheduler.grammar_queue import COMPILE_BUDGET_S, GrammarQueue
from engine.scheduler.output import STATS_TTFT_ZERO, OutputProcessor, StepOutput, _InFlight
from engine.scheduler.prefix_policy import PrefixPolicy
from engine.scheduler.request import FinishReason, Req
from engine.speculative import create_proposer
from engine.speculative.worker import SpecWorker, VerifyBatch

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per step, back toward MIN after a preemption raised it


class Scheduler:
    """Continuous-batching scheduler over a model runner.

    It composes the step's parts: ``ExtendAdder`` (``admission.py``) admits the waiting
    requests of an extend step, ``PrefixPolicy`` (``prefix_policy.py``) orders the queue and
    spots prefix twins, ``GrammarQueue`` (``grammar_queue.py``) holds constrained requests
    until their grammar compiles, ``SpecWorker`` (``engine/speculative/worker.py``) builds
    and runs verify steps, and ``OutputProcessor`` (``output.py``) turns each step's tokens
    into request state and ``StepOutput`` s.

    Args:
        runner: the model runner (a ``StepRunner``: ``forward``, ``sample``,
            ``req_to_token_pool``, ``kv_pool``, ...).
        tokenizer: used to find stop strings in the tail of the output (may be None).
        eos_ids: token ids that end generation unless ``ignore_eos``.
    """

    def __init__(self, args: ServerArgs, runner: StepRunner, tokenizer=None,
                 eos_ids: list[int] | None = None):
        self.args = args
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_ids = sorted(set(eos_ids or []))
        self.req_pool = runner.req_to_token_pool
        self.kv_pool = runner.kv_pool
        self.page_size = self.kv_pool.page_size
        # a pooling engine (embeddings, scores) answers at the end of each prefill; the radix
        # cache stays on when the answer reads the last token only (a shared prefix, such as
        # a reranker's template and query, is computed once), off for mean and CLS pooling
        # (a cached prefix would hide the rows they read)
        self.pooling = runner.pooling
        # a model with recurrent-state (linear-attention) layers reuses a prefix only where
        # the radix tree keeps a snapshot of its states (engine/kv/state_snapshots.py)
        self.recurrent_state = any(s.cache == CacheKind.RECURRENT_STATE
                                   for s in runner.layer_specs)
        snapshots = runner.state_snapshots
        # KV pages, req_to_token rows and the radix prefix cache (engine/kv/manager.py)
        self.kv = KVCacheManager(self.kv_pool, self.req_pool,
                                 disable_cache=getattr(args, "disable_radix_cache", False) or (
                                     self.pooling is not None and self.pooling.needs_every_row)
                                 or (self.recurrent_state and snapshots is None),
                                 swa_pool=runner.swa_pool,
                                 swa_req_pool=runner.swa_req_pool,
                                 state_pool=runner.state_pool, snapshots=snapshots)
        # assert the KV page accounting after every step (tests; costs O(pool) per step)
        self.check_kv = False
        self.chunk_size = prefill_budget(args, runner.device_type)
        #: image patches one step's vision-tower work may take (``ExtendAdder``)
        self.encoder_budget = max(self.chunk_size, args.max_prefill_tokens)
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # the request whose prefill is partly done
        # fraction of their remaining max_tokens that running requests are expected to still
        # generate; admission keeps that much KV free (the idea of SGLang's new_token_ratio)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        # constrained requests wait here until their grammar is compiled
        self.grammars = GrammarQueue(tokenizer, runner.vocab_size, self.eos_ids,
                                     getattr(args, "grammar_compile_timeout", COMPILE_BUDGET_S))
        self.pending_aborts: set[str] = set()
        self.inflight: _InFlight | None = None
        # requests whose prompt an earlier extend step computed: their whole pages go into
        # the prefix cache when the next extend step is built
        self._prefilled: list[Req] = []
        # overlap host scheduling with device work; pointless on the CPU, where ops block
        self.overlap = not args.disable_overlap_schedule and runner.supports_overlap
        # prefix_cache_queries/hits: prompt tokens looked up in the radix cache at admission,
        # and those found (vLLM's counter pair)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0,
                      "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self.stats.update(STATS_TTFT_ZERO)
        self.prefix = PrefixPolicy(self.kv, self.stats, getattr(args, "schedule_policy", "fcfs"))
        self.out = OutputProcessor(tokenizer, self.eos_ids, runner.max_context_len, self.stats,
                                   self._finish)
        # speculative decoding (--speculative-algorithm): verify steps replace small decodes
        proposer = create_proposer(args, runner, tokenizer) \
            if getattr(args, "speculative_algorithm", None) else None
        self.spec = SpecWorker(args, proposer, self.kv, runner, self.stats, self.eos_ids) \
            if proposer else None
        self.lora_served = runner.lora is not None  # adapter slots to fill

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
                    or self.out.outputs or self.inflight or self.grammars)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while any request is queued or running."""
        if self.reqs or self.inflight is not None:
            return False
        return self.kv.flush()

    def _release_grammars(self) -> None:
        """Queue the requests whose grammar compiled; abort those whose compile failed."""
        idle = not (self.running or self.waiting or self.chunked or self.inflight)
        ready, rejected = self.grammars.release(idle)
        self.waiting.extend(ready)
        for req, message in rejected:
            self._abort_now(req, message)

    # ---- KV bookkeeping -----------------------------------------------------------------
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
        if self.kv.decode_short(self.running, self._decode_reserve()):
            # a preempted request is recomputed from its ids: they must be real ones, and
            # the in-flight step may finish (and free) some requests
            self._drain()
        while self.kv.decode_short(self.running, self._decode_reserve()):
            if len(self.running) > 1 or (self.running and self.chunked is None):
                self._preempt(self.running.pop())
            elif self.chunked is not None:
                self._preempt(self.chunked)
                self.chunked = None
            else:
                return

    # ---- batch building -----------------------------------------------------------------
    def _build_extend(self) -> ScheduleBatch | None:
        """Continue the chunked request, admit waiting ones under the chunk budget
        (``ExtendAdder``), and mix in the running decodes as 1-token extends."""
        reserve = self._decode_reserve()  # the pages the running requests' next tokens need
        self._cache_prefilled()
        stepping = self.running + ([self.chunked] if self.chunked is not None else [])
        lora = LoRAGate.for_step(getattr(self.args, "max_loras_per_batch", 0), stepping,
                                 self.waiting, self.lora_served)
        adder = ExtendAdder(self.kv, self.req_pool, self.prefix, lora, self.running,
                            self.chunked, self.chunk_size, reserve,
                            self.args.max_running_requests, self.new_token_ratio,
                            self.kv.swa_decode_reserve(self.running), self.encoder_budget)
        if self.chunked is not None:
            adder.try_add(self.chunked)
        deferred: list[Req] = []
        while adder.open and self.waiting:
            verdict = adder.try_add(self.waiting[0])
            if verdict is Admit.STOP:
                break
            req = self.waiting.popleft()
            if verdict is Admit.DEFER:
                deferred.append(req)
        self.waiting.extendleft(reversed(deferred))
        self.chunked = adder.chunked
        reqs, prefix, ext, sample, locs = (adder.reqs, adder.prefix_lens, adder.ext,
                                           adder.sample, adder.locs)
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

    def _cache_prefilled(self) -> None:
        """Put what earlier steps prefilled (whole prompts and the chunked request's chunks)
        into the prefix cache, so requests admitted now with the same prefix hit it."""
        for r in self._prefilled:
            if not r.finished and r.req_pool_idx is not None:
                self.kv.cache_unfinished(r)
        self._prefilled = []

    def _add_decodes(self, reqs: list[Req], prefix: list[int], locs: list[int]) -> int:
        """Append every running request that gets a KV slot as a one-token step."""
        # evict what the whole step needs at once (an eviction walks the tree)
        self.kv.make_room(sum(self.kv_pool.pages_needed(r.kv_len, len(r.pages), 1)
                              for r in self.running))
        n = 0
        for req in self.running:
            slots = self.kv.grow(req, 1)
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

    def get_next_batch(self) -> ScheduleBatch | VerifyBatch | None:
        self._process_aborts()
        self._release_grammars()
        self.waiting = self.prefix.order(self.waiting)
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
            self._process(prev)
            if not self.overlap:
                self._drain()
        outs = self.out.take()
        if self.check_kv:
            self.kv.check(self.reqs.values())
        return outs

    def _drain(self) -> None:
        """Read back and process the in-flight step, if any."""
        if self.inflight is not None:
            rec, self.inflight = self.inflight, None
            self._process(rec)

    def _process(self, rec: _InFlight | None) -> None:
        """Hand a launched step's results to the output processor; drop finished requests."""
        if rec is not None and self.out.process(rec):
            self.running = [r for r in self.running if not r.finished]

    def _run_verify(self, vb: VerifyBatch) -> None:
        """Run a verify step now (it is never left in flight: the next step's positions
        depend on what it accepts) and hand each request's accepted run to the output
        processor."""
        try:
            runs = self.spec.step(vb)
        except Exception as exc:  # as in _launch: fail this batch, keep serving
            self._fail(vb.reqs, exc, "verify step")
            return
        self.stats["steps"] += 1
        for req, toks, logprobs in runs:
            self.out.emit_run(req, toks, logprobs)
        self.running = [r for r in self.running if not r.finished]

    def _launch(self, batch: ScheduleBatch) -> _InFlight | None:
        """Run ``batch``'s forward and start its sampling; the sampled ids stay on the device
        (placeholders in ``output_ids``) until the returned step is processed."""
        sample_rows = [i for i, s in enumerate(batch.sample) if s]
        reqs = [batch.reqs[i] for i in sample_rows]
        needs_ids = self.inflight is not None and any(_needs_output_ids(r) for r in reqs)
        future = self.inflight.result.ids_dev if self.inflight is not None else None
        try:
            self._snapshot_prefills(batch)
            logits = self.runner.forward(batch, future)
            if self.pooling is not None:  # no sampling, no decode: the prompt is the request
                return self._pool(batch, logits)
            if self.spec is not None:  # an EAGLE head keeps the hidden states of the step
                self.spec.proposer.observe(batch)
            if needs_ids:
                # while this forward runs: read the in-flight step back, so the grammars
                # accept its tokens (this step's masks follow from them) and penalties see
                # real ids; a request that finished there keeps its row, unused
                self._drain()
            if batch.all_rows:
                rows = batch.logits_rows()
                self.out.prompt_logprobs(batch, logits, rows)
                logits = logits[[rows[i][0] + rows[i][1] - 1 for i in sample_rows]]
            elif len(sample_rows) != batch.batch_size:
                logits = logits[sample_rows]
            result = self.runner.sample(logits, reqs, self.eos_ids) if reqs else None
        except Exception as exc:  # a bug or a device error: fail this batch, keep serving
            self._fail(batch.reqs, exc, "step")
            return None
        self.stats["steps"] += 1
        self._count_prompt_tokens(batch)
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

    def _snapshot_prefills(self, batch: ScheduleBatch) -> None:
        """A hybrid model with the prefix cache on: snapshot the linear layers' states of
        the step's prefill rows where their chunk ends on a page boundary
        (``KVCacheManager.snapshot_rows``); the model runner copies them right after
        launching the forward (``batch.snap_takes``), on every tensor-parallel rank."""
        if self.kv.snapshots is not None and batch.mode == ForwardMode.EXTEND:
            batch.snap_takes = self.kv.snapshot_rows(
                batch.reqs[:batch.batch_size - batch.num_decodes], copy=False)

    def _pool(self, batch: ScheduleBatch, logits) -> None:
        """A pooling engine's step: fold the step's hidden states into its requests; those
        whose prompt ended get their answer and finish (their KV freed at once, or given to
        the radix cache when it is on)."""
        answers = self.runner.pool(batch, logits)
        self.stats["steps"] += 1
        self._count_prompt_tokens(batch)
        for req, answer in answers:
            self._finish(req, FinishReason("stop"))
            self.out.pooled(req, answer)

    def _count_prompt_tokens(self, batch: ScheduleBatch) -> None:
        """Add the prompt tokens ``batch`` computed for the first time to the stats."""
        n_prompt = 0
        for i, req in enumerate(batch.reqs):
            end = min(batch.prefix_lens[i] + batch.extend_lens[i], len(req.origin_input_ids))
            start = max(batch.prefix_lens[i], req.prompt_counted)
            if end > start:
                n_prompt += end - start
                req.prompt_counted = end
        self.stats["prompt_tokens"] += n_prompt

    def _fail(self, reqs: list[Req], exc: Exception, what: str) -> None:
        """A step raised (a bug or a device error): abort its requests (after reading back
        the step in flight, if any) and keep serving.

        Raises:
            ``exc`` again with tensor parallelism: the other ranks may be inside the step's
            collectives, so they must all stop.
        """
        if self.runner.tp_size > 1:
            raise exc
        logger.exception("%s failed; aborting %d requests", what, len(reqs))
        self._drain()
        for req in reqs:
            if not req.finished:
                self._abort_now(req, f"internal error: {exc}", cache=False)

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
        self.out.aborted(req)


def _needs_output_ids(req: Req) -> bool:
    sp = req.sampling_params
    # a grammar's mask for this step needs the previous token accepted into its matcher
    return (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
            or sp.repetition_penalty != 1.0 or req.grammar is not None)
