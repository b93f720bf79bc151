"""``SpecWorker``: the speculative decode step, run by the scheduler instead of a 1-token
decode when every running request is decoding and the batch is small enough
(``--speculative-max-batch-size``).

One step, for the running requests together:

1. Propose: up to k drafts per request (``Proposer``), fewer near ``max_tokens`` or the
   context end, none for a request with a grammar (its matcher cannot take unverified
   tokens yet: it decodes one token per step inside the same batch).
2. Allocate: every request gets its one decode slot (the scheduler's ``_retract`` made room
   for those); drafts get slots only where the pool has them beyond that reserve.
3. Verify: one forward over ``[last token, d1..dk]`` at positions ``[L, L+1..L+k]`` per
   request, logits for all k + 1 positions. While the extra KV it reads is small against
   the weights (``VERIFY_AS_DECODE_KV_SHARE``), the step is a DECODE of k + 1 rows per
   request, row j at position L + j over the same ``req_to_token`` row: each layer stores
   every row's K/V before attention, so row j sees exactly positions <= L + j (causal), and
   the step takes the decode path (its graphs, the CPU's C++ decode kernel) where an EXTEND
   would run eager extend attention; row j reads the prefix again, which is what bounds it.
   Otherwise it is an EXTEND over the cached prefix with logits for every row
   (``all_rows``). A request without drafts is one row, a plain decode (on a hybrid model:
   1 + k rows, all but the first padding).
4. Accept (``engine/sampling/acceptance.py``): the longest run of drafts the target keeps,
   plus the target's own token after it; the KV of the rejected positions is dropped
   (``KVCacheManager.shrink``), so ``req_to_token`` and the radix cache only ever hold
   accepted tokens. A model with linear-attention layers always verifies as a DECODE of
   exactly k + 1 rows a request (``padded_verify_batch``: a request with fewer drafts gets
   padding rows, so the step has the shape its verify graph was captured at), whose
   linear layers leave each request's recurrent state as it was and keep the state after
   every row in scratch slots (``ScheduleBatch.verify_n``); the runner's ``commit_verify``
   then copies the one after the last accepted token into the request's slot
   (``engine/kv/state_pool.py``). ``SpecWorker.step`` returns each request's run
   (``AcceptedRun``); the scheduler's ``OutputProcessor`` appends it with its stop checks
   (a stop token or string inside the run cuts it there).

The step is synchronous: the next step's positions and drafts depend on how many tokens
this one accepted, so with overlap scheduling the in-flight step is drained before a verify
step, and nothing is launched behind it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine import device as dev
from engine.args import ServerArgs, num_draft_tokens
from engine.executor.schedule_batch import ScheduleBatch, padded_verify_batch
from engine.executor.step_runner import StepRunner
from engine.forward_batch import ForwardMode
from engine.sampling.acceptance import verify_drafts
from engine.speculative.proposer import Proposer

logger = logging.getLogger(__name__)

#: the spec counters the worker adds to ``Scheduler.stats`` (/server_info, /metrics); it
#: also keeps ``spec_verify_step_seconds`` and ``spec_decode_step_seconds`` there once
#: measured (the step-time averages of ``wants``)
#: a request below break-even this many verify steps in a row stops proposing for 2, 4,
#: 8... steps (up to MAX_BACKOFF), then tries again. Below break-even: nothing accepted, or
#: its running accept length (tokens per verify step, an exponential average with weight
#: ACCEPT_EMA on the newest step) under the measured cost of a verify step in plain decode
#: steps (``SpecWorker.breakeven``): a verify step then costs more than it returns
#: (non-copying text drafted from weak one-token matches; on the CPU a verify row costs
#: nearly a decode step's compute, on a GPU a few percent)
MISSES_BEFORE_BACKOFF = 2
MAX_BACKOFF = 32
ACCEPT_EMA = 0.5
#: weight of the newest step in the step-time averages the break-even comes from
STEP_TIME_EMA = 0.1
#: verify as decode rows while the KV those rows read beyond a plain decode step (k x the
#: context per request) is at most this share of the weight bytes a step reads
VERIFY_AS_DECODE_KV_SHARE = 0.25
SPEC_STAT_KEYS = ("spec_verify_steps", "spec_verify_reqs", "spec_proposed_tokens",
                  "spec_accepted_tokens", "spec_emitted_tokens")


class VerifyReq:
    """A request's ``StepRequest`` for the verify forward: its tokens with the drafts after
    them (the request itself holds only accepted tokens)."""

    __slots__ = ("req", "req_pool_idx", "state_slot", "mm", "drafts", "base")

    def __init__(self, req, drafts: list[int]):
        self.req = req
        self.req_pool_idx = req.req_pool_idx
        # the request's recurrent-state slot (a model with linear-attention layers)
        self.state_slot = getattr(req, "state_slot", None)
        # an image request's M-RoPE positions: the drafts sit at ``p + delta`` (as decodes)
        self.mm = getattr(req, "mm", None)
        self.drafts = drafts
        self.base = req.seq_len

    def token_at(self, pos: int) -> int:
        return self.drafts[pos - self.base] if pos >= self.base else self.req.token_at(pos)

    def tokens(self, start: int, count: int) -> list[int]:
        end, b = start + count, self.base
        if end <= b:
            return self.req.tokens(start, count)
        head = self.req.tokens(start, b - start) if start < b else []
        return head + self.drafts[max(0, start - b): end - b]


class AcceptedRun(NamedTuple):
    """What a verify step emitted for one request."""

    req: object
    #: the accepted drafts, then the target's own next token
    tokens: list[int]
    #: per token ``(logprob, [[id, logprob], ...top k])`` when the request asked for
    #: logprobs (raw logits, as ``sample`` reports them), else None
    logprobs: list | None


@dataclass
class VerifyBatch:
    """A built verify step: the forward's batch, and per request its drafts."""

    batch: ScheduleBatch
    reqs: list
    drafts: list[list[int]]
    prefix: list[int]  # per request, its KV length before the step (the last token's position)
    # a padded verify step (hybrid models): the requests' own rows of ``batch`` (int64 on the
    # device) and the same step without the padding rows, which the proposer observes
    rows: torch.Tensor | None = None
    observed: ScheduleBatch | None = None


class SpecWorker:
    """Builds and runs verify steps over a runner and the scheduler's KV manager.

    Args:
        args: the server arguments (k, the max batch size).
        proposer: where drafts come from.
        kv: the scheduler's ``KVCacheManager``.
        runner: the model runner (``forward``, ``vocab_size``, ``max_context_len``,
            ``max_verify_rows``, ``memory_report``, ``kv_pool``).
        stats: the scheduler's stats dict; the worker adds its counters and
            ``spec_accept_lengths`` (index i: steps where a request emitted i + 1 tokens).
        eos_ids: the model's stop tokens (the acceptance's sampling needs them).
    """

    def __init__(self, args: ServerArgs, proposer: Proposer, kv, runner: StepRunner,
                 stats: dict, eos_ids: list[int] | None = None):
        self.k = num_draft_tokens(args)
        self.max_bs = args.speculative_max_batch_size
        self.eos_ids = list(eos_ids or [])
        # the CPU: a verify step's rows cost nearly a decode step's compute each, and past
        # the runner's small-M rows the 4-bit linear layers dequantize their weights per
        # call (bench_spec_steps, embedded model: verify at bs8 2-8x a decode step)
        self.max_rows = runner.max_verify_rows
        self.algorithm = args.speculative_algorithm
        self.proposer = proposer
        self.kv = kv
        self.runner = runner
        self.stats = stats
        self.reset_stats()
        mem = runner.memory_report()  # this rank's bytes (a shard under TP: the same ratio)
        self._weight_bytes = mem["weight_bytes"]
        self._kv_token_bytes = mem["kv_bytes"] / max(1, runner.kv_pool.num_slots)
        # rid -> [consecutive verify steps below break-even, steps left without drafts]
        self._misses: dict[str, list[int]] = {}
        self._accept_len: dict[str, float] = {}  # rid -> running accept length
        # step times (s, averaged) of verify steps and of plain decode steps of speculating
        # batches, measured between consecutive scheduler steps (see ``wants``)
        self.clock = time.perf_counter
        self.step_time = {"verify": None, "decode": None}
        self._mark: tuple[float, int, str | None] | None = None

    def reset_stats(self) -> None:
        self.stats.update(dict.fromkeys(SPEC_STAT_KEYS, 0))
        self.stats["spec_accept_lengths"] = [0] * (self.k + 1)

    def info(self) -> dict:
        """What /server_info shows: the algorithm, its settings, the mean accept length."""
        v, d = self.step_time["verify"], self.step_time["decode"]
        return {"algorithm": self.algorithm, "num_draft_tokens": self.k,
                "max_batch_size": self.max_bs, "mean_accept_length": mean_accept_length(self.stats),
                "verify_step_ms": v and v * 1e3, "decode_step_ms": d and d * 1e3,
                "breakeven_accept_length": self.breakeven,
                # EAGLE: whether the head's draft steps replay device graphs
                "head_graphs": getattr(self.proposer, "head_graphs", None) is not None}

    def wants(self, running: list) -> bool:
        """Whether a decode step over ``running`` speculates (a larger batch decodes; so does
        one whose verify rows, ``(1 + k)`` per request, pass the runner's
        ``max_verify_rows``: the CPU's small-M kernel).

        Called once per scheduler step that decodes: the time since the previous call is
        the previous step's, which ``build`` labelled verify or decode; it counts when
        exactly one scheduler step ran in between (``stats["steps"]``), so a prefill step
        between two decodes is not taken for either."""
        now, steps = self.clock(), self.stats.get("steps", 0)
        if self._mark is not None:
            t0, s0, kind = self._mark
            if kind is not None and steps == s0 + 1:
                old = self.step_time[kind]
                dt = now - t0
                self.step_time[kind] = dt if old is None else \
                    old + STEP_TIME_EMA * (dt - old)
                # /metrics: the step costs (gauges; server/metrics.py)
                self.stats[f"spec_{kind}_step_seconds"] = self.step_time[kind]
        ok = 0 < len(running) <= self.max_bs and \
            (self.max_rows is None or len(running) * (1 + self.k) <= self.max_rows)
        self._mark = (now, steps, None)
        return ok

    @property
    def breakeven(self) -> float:
        """A verify step's measured cost in plain decode steps (1.0 until both are
        measured): the accept length below which speculating loses."""
        v, d = self.step_time["verify"], self.step_time["decode"]
        return v / d if v and d else 1.0

    def _label(self, kind: str) -> None:
        if self._mark is not None:
            self._mark = (self._mark[0], self._mark[1], kind)

    def budget(self, req) -> int:
        """Drafts ``req`` may have: k, fewer where max_tokens or the context is near (a
        step emits at most drafts + 1 tokens), none under a grammar."""
        if getattr(req, "grammar", None) is not None:
            return 0
        miss = self._misses.get(req.rid)
        if miss is not None and miss[1] > 0:
            miss[1] -= 1  # backing off: decode this step
            return 0
        return max(0, min(self.k, req.max_new_tokens - len(req.output_ids) - 1,
                          self.runner.max_context_len - req.seq_len - 1))

    # ---- build --------------------------------------------------------------------------
    def build(self, running: list) -> VerifyBatch | None:
        """Propose and allocate; None (nothing allocated) when no request has a draft."""
        live = {r.rid for r in running}
        for per_rid in (self._misses, self._accept_len):  # forget ended requests
            for rid in [rid for rid in per_rid if rid not in live]:
                del per_rid[rid]
        self._label("decode")  # unless a verify batch is built below
        ks = [self.budget(r) for r in running]
        drafts = self.proposer.propose_reqs(running, ks)
        if not any(drafts):
            return None
        kv, pool = self.kv, self.kv.pool
        ps = pool.page_size
        # pages the 1-token decodes of all running requests need (the scheduler's reserve)
        reserve = sum(pool.pages_needed(r.kv_len, len(r.pages), 1) for r in running)
        reqs, vreqs, prefix, ext, locs, kept = [], [], [], [], [], []
        for r, d in zip(running, drafts):
            own = pool.pages_needed(r.kv_len, len(r.pages), 1)
            reserve -= own
            if d and kv.available_tokens() // ps - reserve < \
                    pool.pages_needed(r.kv_len, len(r.pages), 1 + len(d)):
                d = []  # the pool is short: this request decodes one token
            slots = kv.grow(r, 1 + len(d))
            if slots is None and d:
                d = []
                slots = kv.grow(r, 1)
            if slots is None:
                continue  # as a plain decode step does: it waits for the next step
            reqs.append(r)
            vreqs.append(VerifyReq(r, d))
            prefix.append(r.kv_len)
            ext.append(1 + len(d))
            locs.extend(slots)
            r.kv_len += 1 + len(d)
            kept.append(d)
        if not reqs:
            return None
        self._label("verify")
        if self.runner.state_pool is not None:
            # linear-attention layers: n rows a request (padded), the state after each row
            # kept for the commit after acceptance (``_accept``)
            batch, rows = padded_verify_batch(vreqs, prefix, ext, locs, 1 + self.k)
            return VerifyBatch(batch, reqs, kept, prefix, dev.host_to_device(
                torch.tensor(rows, dtype=torch.int64), self.runner.device),
                verify_batch(vreqs, prefix, ext, locs, True))
        extra_kv = sum((n - 1) * p for p, n in zip(prefix, ext)) * self._kv_token_bytes
        as_decode = extra_kv <= VERIFY_AS_DECODE_KV_SHARE * self._weight_bytes
        return VerifyBatch(verify_batch(vreqs, prefix, ext, locs, as_decode), reqs, kept,
                           prefix)

    # ---- run ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, vb: VerifyBatch) -> list[AcceptedRun]:
        """Run the verify step: forward, accept, and drop the rejected KV.

        Returns:
            per request of ``vb``, its ``AcceptedRun``: the emitted run (accepted drafts
            plus the target's next token) and, for a request that asked for logprobs, one
            ``(logprob, top)`` entry per token.

        Raises:
            whatever the runner's forward raises (the scheduler fails the batch).
        """
        from engine.sampling.grammar import fill_vocab_mask
        from engine.sampling.sampler import SamplingBatchInfo

        logits = self.runner.forward(vb.batch)
        if vb.rows is not None:  # a padded verify step: its requests' own rows
            logits = logits.index_select(0, vb.rows)
            model = self.runner.model
            if getattr(model, "hidden_out", None) is not None:
                model.hidden_out = model.hidden_out.index_select(0, vb.rows)
        self.proposer.observe(vb.observed or vb.batch)
        params, steps, row_drafts, grammars = [], [], [], []
        outs: list | None = [] if any(_penalised(r) for r in vb.reqs) else None
        for req, d in zip(vb.reqs, vb.drafts):
            n = len(req.output_ids)
            for j in range(len(d) + 1):
                params.append(req.sampling_params)
                steps.append(n + j)
                row_drafts.append(d[j] if j < len(d) else -1)
                grammars.append(getattr(req, "grammar", None))
                if outs is not None:
                    outs.append(req.output_ids + d[:j])
        prompts = [r.origin_input_ids for r, d in zip(vb.reqs, vb.drafts) for _ in range(len(d) + 1)]
        info = SamplingBatchInfo.from_params(
            params, self.runner.vocab_size, logits.device, output_ids=outs,
            prompt_ids=prompts if outs is not None else None, steps=steps, eos_ids=self.eos_ids)
        info.vocab_mask = fill_vocab_mask(grammars, self.runner.vocab_size)
        drafts_t = dev.host_to_device(torch.tensor(row_drafts, dtype=torch.int64),
                                      logits.device)
        acc_t, emit_t = verify_drafts(logits, info, drafts_t)
        want = [p.logprobs for p in params if p.logprobs is not None]
        lp = None
        if want:
            chosen = torch.where(acc_t, drafts_t, emit_t)
            lsm = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(lsm, min(max(want), lsm.shape[1]), dim=-1)
            lp = (lsm.gather(1, chosen[:, None])[:, 0].tolist(), top.indices.tolist(),
                  top.values.tolist())
        acc, emit = torch.stack([acc_t.long(), emit_t]).tolist()  # one host sync
        return self._accept(vb, acc, emit, lp)

    def _accept(self, vb: VerifyBatch, acc: list[bool], emit: list[int], lp
                ) -> list[AcceptedRun]:
        st, lengths = self.stats, self.stats["spec_accept_lengths"]
        st["spec_verify_steps"] += 1
        out, r0, keep = [], 0, []
        for req, d, p in zip(vb.reqs, vb.drafts, vb.prefix):
            a = 0
            while a < len(d) and acc[r0 + a]:
                a += 1
            toks = d[:a] + [emit[r0 + a]]
            logprobs = None
            if lp is not None and req.sampling_params.logprobs is not None:
                k = req.sampling_params.logprobs
                logprobs = [(lp[0][r], [[lp[1][r][j], lp[2][r][j]] for j in range(k)])
                            for r in range(r0, r0 + a + 1)]
            # positions p..p+a hold the last token and the accepted drafts: keep those
            keep.append(1 + a)
            self.kv.shrink(req, p + 1 + a)
            self.proposer.trim(req, p + 1 + a)
            if d:
                st["spec_verify_reqs"] += 1
                st["spec_proposed_tokens"] += len(d)
                st["spec_accepted_tokens"] += a
                st["spec_emitted_tokens"] += a + 1
                lengths[a] += 1
                self._track(req.rid, a)
            out.append(AcceptedRun(req, toks, logprobs))
            r0 += len(d) + 1
        if vb.batch.verify_n:  # the linear layers' states: after the last accepted token
            self.runner.commit_verify(keep)
        return out

    def _track(self, rid: str, accepted: int) -> None:
        """Back off a request below break-even (see ``MISSES_BEFORE_BACKOFF``)."""
        old = self._accept_len.get(rid)
        acc = accepted + 1.0 if old is None else old + ACCEPT_EMA * (accepted + 1.0 - old)
        self._accept_len[rid] = acc
        if accepted and acc >= self.breakeven:
            self._misses.pop(rid, None)
            return
        miss = self._misses.setdefault(rid, [0, 0])
        miss[0] += 1
        if miss[0] >= MISSES_BEFORE_BACKOFF:
            miss[1] = min(MAX_BACKOFF, 2 ** (miss[0] - MISSES_BEFORE_BACKOFF + 1))


def verify_batch(reqs: list, prefix: list[int], ext: list[int], locs: list[int],
                 as_decode: bool) -> ScheduleBatch:
    """The verify forward's batch: request i scores ``ext[i]`` tokens from position
    ``prefix[i]`` (its last token and its drafts), into the slots ``locs`` (batch order), with
    logits for every one of them, in that order.

    ``as_decode``: a DECODE batch of ``ext[i]`` rows per request (row j at position
    ``prefix[i] + j``, the same request object and ``req_to_token`` row); else an EXTEND with
    ``all_rows``. Both give the same logits rows (see the module docstring)."""
    if as_decode:
        rows = [r for r, n in zip(reqs, ext) for _ in range(n)]
        pos = [p + j for p, n in zip(prefix, ext) for j in range(n)]
        return ScheduleBatch(ForwardMode.DECODE, rows, pos, [1] * len(rows), [True] * len(rows),
                             locs)
    return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix, ext, [True] * len(reqs), locs,
                         [True] * len(reqs))


def mean_accept_length(stats: dict) -> float | None:
    """Tokens a speculating request emitted per verify step, on average (accepted drafts
    plus the target's own token; 1.0 = no draft ever taken); None before any."""
    n = stats.get("spec_verify_reqs", 0)
    return stats["spec_emitted_tokens"] / n if n else None


def _penalised(req) -> bool:
    sp = req.sampling_params
    return (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
            or sp.repetition_penalty != 1.0)
