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
from engine.executor.forward_batch import ForwardMode
from engine.scheduler.request import FinishReason, Req
from engine.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001  # per step, back toward MIN after a preemption raised it
FUTURE_TOKENS_CLIP = 4096
PROMPT_LOGPROBS_CHUNK = 512  # prompt tokens per step for a request that wants their logprobs


class StepOutput:
    """What one step produced for one request: new tokens (possibly none) and its finish."""

    __slots__ = ("req", "new_token_ids", "finished_reason")

    def __init__(self, req: Req, new_token_ids: list[int], finished_reason: FinishReason | None):
        self.req = req
        self.new_token_ids = new_token_ids
        self.finished_reason = finished_reason


#: TTFT parts summed over requests (``Scheduler.stats``, reported by /server_info): seconds
#: from the server's arrival to the scheduler's receipt (HTTP, tokenization, IPC), and from
#: the receipt to the first token read back on the host (waiting, prefill, sampling)
STATS_TTFT_ZERO = {"first_tokens": 0, "ttft_queue_s_sum": 0.0, "ttft_engine_s_sum": 0.0}


class Scheduler:
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
        self.chunk_size = prefill_budget(args, getattr(runner, "device_type", "cpu"))
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # the request whose prefill is partly done
        # fraction of their remaining max_tokens that running requests are expected to still
        # generate; admission keeps that much KV free (the idea of SGLang's new_token_ratio)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.pending_aborts: set[str] = set()
        self.finished_outputs: list[StepOutput] = []
        self.inflight: _InFlight | None = None
        # overlap host scheduling with device work; pointless on the CPU, where ops block
        self.overlap = (not args.disable_overlap_schedule
                        and getattr(runner, "supports_overlap", False))
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0}
        self.stats.update(STATS_TTFT_ZERO)

    # ---- queue --------------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def abort_request(self, rid: str, message: str | None = None) -> None:
        """Drop a request at the next step (frees its KV). Unknown rids are ignored."""
        if rid in self.reqs:
            self.pending_aborts.add(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.pending_aborts
                    or self.finished_outputs or self.inflight)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- KV bookkeeping -----------------------------------------------------------------
    def _grow(self, req: Req, n: int) -> list[int] | None:
        """Allocate slots for ``n`` more tokens of ``req``; None (nothing taken) if no room."""
        return self.kv_pool.grow(req.pages, req.kv_len, n)

    def _release(self, req: Req) -> None:
        if req.pages:
            self.kv_pool.free_pages(req.pages)
            req.pages = []
        if req.req_pool_idx is not None:
            self.req_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.kv_len = 0

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        self._release(req)
        self.reqs.pop(req.rid, None)

    # ---- batch building -----------------------------------------------------------------
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
        self._release(req)
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
        if self.kv_pool.free_tokens() < self._decode_reserve():
            # a preempted request is recomputed from its ids: they must be real ones, and
            # the in-flight step may finish (and free) some requests
            self._drain()
        while self.kv_pool.free_tokens() < self._decode_reserve():
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
        while budget > 0:
            if self.chunked is not None:
                req = self.chunked
            elif self.waiting:
                req = self.waiting[0]
                if len(self.running) + len(reqs) >= max_running or self.req_pool.available() == 0:
                    break
                # a new request must fit with everything it and the others will still need;
                # alone it is always admitted (no request outgrows the pool)
                own = req.seq_len - req.kv_len + self.new_token_ratio * self._future_tokens(req)
                if (self.running or reqs) and self.kv_pool.free_tokens() - reserve < own + future:
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
                + self.kv_pool.free_tokens() - reserve
            if room < n:
                n = room
                if n <= 0:
                    break
            if req.req_pool_idx is None:
                req.req_pool_idx = self.req_pool.alloc()
            if req is not self.chunked:
                self.waiting.popleft()
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
        if not reqs:
            return None
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
        batch = self._build_extend() if (self.waiting or self.chunked) else None
        return batch if batch is not None else self._build_decode()

    # ---- run + results ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one scheduler step; returns outputs of requests that produced tokens or ended.

        With overlap on, step N+1 is launched before step N's sampled ids are read back: the
        requests of step N carry placeholder ids (``-(k + 1)``, row k of step N's sampled-id
        tensor) that the model runner resolves on the device. Anything that needs real ids
        first (preemption, penalties) drains the in-flight step before it goes on.
        """
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        batch = self.get_next_batch()
        if batch is None:
            self._drain()
        else:
            rec = self._launch(batch)
            prev, self.inflight = self.inflight, rec
            if prev is not None:
                self._process(prev)
            if not self.overlap:
                self._drain()
        outs, self.finished_outputs = self.finished_outputs, []
        return outs

    def _drain(self) -> None:
        """Read back and process the in-flight step, if any."""
        if self.inflight is not None:
            rec, self.inflight = self.inflight, None
            self._process(rec)

    def _launch(self, batch: ScheduleBatch) -> _InFlight | None:
        sample_rows = [i for i, s in enumerate(batch.sample) if s]
        reqs = [batch.reqs[i] for i in sample_rows]
        if self.inflight is not None and any(_needs_output_ids(r) for r in reqs):
            self._drain()  # penalties count the generated ids: they must be real ones
        future = self.inflight.result.ids_dev if self.inflight is not None else None
        try:
            logits = self.runner.forward(batch, future)
            if batch.all_rows:
                rows = batch.logits_rows()
                self._prompt_logprobs(batch, logits, rows)
                logits = logits[[rows[i][0] + rows[i][1] - 1 for i in sample_rows]]
            elif len(sample_rows) != batch.batch_size:
                logits = logits[sample_rows]
            result = self.runner.sample(logits, reqs, self.eos_ids) if reqs else None
        except Exception as exc:  # a bug or a device error: fail this batch, keep serving
            logger.exception("step failed; aborting %d requests", batch.batch_size)
            self._drain()
            for req in batch.reqs:
                if not req.finished:
                    self._abort_now(req, f"internal error: {exc}")
            return None
        self.stats["steps"] += 1
        n_prompt = 0
        for i, req in enumerate(batch.reqs):
            n_prompt += max(0, min(batch.prefix_lens[i] + batch.extend_lens[i],
                                   len(req.origin_input_ids)) - batch.prefix_lens[i])
        self.stats["prompt_tokens"] += n_prompt
        slots = []
        running = {id(r) for r in self.running}
        for k, req in enumerate(reqs):
            req.output_ids.append(-(k + 1))
            slots.append((req, len(req.output_ids) - 1, k))
            if id(req) not in running:
                self.running.append(req)
        return _InFlight(result, slots) if slots else None

    def _prompt_logprobs(self, batch: ScheduleBatch, logits, rows) -> None:
        """Log-probabilities of the prompt tokens (echo): the logits at position j score
        prompt token j + 1. Top-k alternatives come with each (k = prompt_logprobs)."""
        import torch

        for i, req in enumerate(batch.reqs):
            if not batch.all_rows[i]:
                continue
            r0, n = rows[i]
            p = batch.prefix_lens[i]
            prompt = req.origin_input_ids
            m = min(n, len(prompt) - 1 - p)  # rows whose next token is still in the prompt
            skip = len(req.prompt_logprobs) - 1 - p  # rows done before a preemption
            if skip < 0 or m - skip <= 0:
                continue
            k = req.sampling_params.prompt_logprobs
            for a in range(r0 + skip, r0 + m, 128):  # 128 rows of log-softmax at a time
                b = min(a + 128, r0 + m)
                lp = torch.log_softmax(logits[a:b].float(), dim=-1)
                nxt = torch.tensor(prompt[p + 1 + a - r0: p + 1 + b - r0], device=lp.device)
                chosen = lp.gather(1, nxt[:, None])[:, 0].tolist()
                if k:
                    top_lp, top_id = lp.topk(k, dim=-1)
                    top = [[[x, y] for x, y in zip(ids, lps)]
                           for ids, lps in zip(top_id.tolist(), top_lp.tolist())]
                else:
                    top = [[] for _ in range(b - a)]
                req.prompt_logprobs.extend(zip(chosen, top))

    def _process(self, rec: _InFlight | None) -> None:
        if rec is None:
            return
        ids, lp = rec.result.host()
        now = time.time()
        any_finished = False
        for req, idx, k in rec.slots:
            if req.finished:
                continue  # aborted, or finished one step earlier while this step was in flight
            tok = ids[k]
            req.output_ids[idx] = tok
            self.stats["generation_tokens"] += 1
            if lp is not None and req.sampling_params.logprobs is not None:
                top = req.sampling_params.logprobs
                tops = [[lp[1][k][j], lp[2][k][j]] for j in range(top)] if lp[1] else []
                req.logprobs.append((lp[0][k], tops))
            if req.first_token_time is None:
                req.first_token_time = now
                st = self.stats
                st["first_tokens"] += 1
                st["ttft_queue_s_sum"] += max(0.0, req.recv_time - req.arrival_time)
                st["ttft_engine_s_sum"] += now - req.recv_time
            reason = self._check_finished(req, tok, idx + 1)
            if reason is not None:
                del req.output_ids[idx + 1:]  # a placeholder of a step launched after this one
                self._finish(req, reason)
                any_finished = True
            self.finished_outputs.append(StepOutput(req, [tok], reason))
        if any_finished:
            self.running = [r for r in self.running if not r.finished]

    def _abort_now(self, req: Req, message: str) -> None:
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
        self._finish(req, FinishReason("abort", message=message))
        self.finished_outputs.append(StepOutput(req, [], req.finished_reason))

    def _check_finished(self, req: Req, tok: int, n_out: int) -> FinishReason | None:
        """Stop conditions after the ``n_out``-th generated token ``tok``."""
        sp = req.sampling_params
        if n_out >= sp.min_tokens:
            if tok in sp.stop_token_ids:
                return FinishReason("stop", matched=tok)
            if not sp.ignore_eos and tok in self.eos_ids:
                return FinishReason("stop", matched=tok)
            if req.stop_window and self.tokenizer is not None:
                tail = self.tokenizer.decode(req.output_ids[max(0, n_out - req.stop_window): n_out],
                                             skip_special_tokens=sp.skip_special_tokens)
                # the window may start or end inside a multi-byte character: its pieces decode
                # to U+FFFD, which is not text the detokenizer will ever show
                tail = tail.strip("\ufffd")
                for s in sp.stop:
                    if s in tail:
                        return FinishReason("stop", matched=s)
        if n_out >= req.max_new_tokens:
            return FinishReason("length")
        if len(req.origin_input_ids) + n_out >= self.runner.max_context_len:
            return FinishReason("length")
        return None


class _InFlight:
    """A launched step: its sample result and (req, output index, sampled row) per request."""

    __slots__ = ("result", "slots")

    def __init__(self, result, slots):
        self.result = result
        self.slots = slots


def _needs_output_ids(req: Req) -> bool:
    sp = req.sampling_params
    return (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
            or sp.repetition_penalty != 1.0)
