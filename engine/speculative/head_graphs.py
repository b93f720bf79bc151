"""Device graphs for an EAGLE head's draft DECODE steps (``EagleProposer``).

After the catch-up EXTEND (eager: its shapes vary) gives each request its first draft token,
the further draft tokens of a chain come from one DECODE step of the head each. Run
eagerly, each step costs python, ~40 small kernel launches and a host sync; here the step
(head + greedy argmax) is captured once per batch-size bucket (``batch_size_buckets`` up to
``--speculative-max-batch-size``) and the whole chain runs on the device with one host sync:

- the KV slots of every step are taken up front (``ModelProposer._grow``), so every step's
  positions, ``seq_lens``, slots and ``req_to_token`` entries are known before the first
  replay: one host -> device copy (:func:`pack_chain`) and one ``req_to_token`` write;
- the captured step writes its tokens and next hidden states back into its own input
  buffers, so step ``s + 1`` reads what step ``s`` drafted without the host;
- each step's tokens are copied aside (``drafted``) and read with one ``.tolist()``.

Padding rows (a batch padded to its bucket, or a request whose chain ended before the
others') point at ``req_to_token`` row 0 and pool slot 0, the padding sink, as the target's
decode graphs do (``engine/executor/graph_runner.py``).

Positions: the head's KV index ``c`` (``req_to_token`` column, ``seq_lens``) is relative to
the request's ``DraftSeq.base``; its rotary position is ``base + c``.

Without graphs (``capture=False``: the CPU tests) the same step runs eagerly on the same
static buffers, with the backend's ``init_forward``.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from engine import device as dev
from engine.executor.graph_runner import batch_size_buckets
from engine.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

#: the rows of :func:`pack_chain`'s tensor
ID, POS, ROW, LOC, LEN, KV = range(6)


def pack_chain(rows: list[tuple[int, int, int, list[int], int]], steps: int,
               gbs: int) -> torch.Tensor:
    """The host side of a chain of ``steps`` head DECODE steps over a batch padded to ``gbs``.

    Args:
        rows: per request ``(req_pool_idx, base, kv_start, slots, first_id)``: its draft
            ``req_to_token`` row, ``DraftSeq.base``, its KV length before the chain, the pool
            slots of its steps (``len(slots) <= steps``: it runs that many), the input id of
            its first step.
        steps: the chain's length; gbs: the padded batch size (``>= len(rows)``).
    Returns:
        int64 ``[steps, 6, gbs]``; row ``r`` of step ``s`` holds at ``[s, :, r]``: ``ID`` the
        input id (step 0 only; later steps read the previous step's output), ``POS`` the
        rotary position ``base + kv_start + s``, ``ROW`` the ``req_to_token`` row, ``LOC`` the
        slot, ``LEN`` the head's ``seq_len`` ``kv_start + s + 1``, ``KV`` the ``req_to_token``
        column ``kv_start + s``. A padding entry (past ``len(rows)``, or past a request's
        slots) is ``(0, 0, 0, 0, 1, 0)``: row 0, slot 0, one token.
    Raises:
        ValueError: more rows than ``gbs``, or a request with more slots than ``steps``.
    """
    if len(rows) > gbs or any(len(r[3]) > steps for r in rows):
        raise ValueError(f"{len(rows)} rows for a batch of {gbs}, or more slots than the "
                         f"chain's {steps} steps")
    out = torch.zeros(steps, 6, gbs, dtype=torch.int64)
    out[:, LEN] = 1
    for j, (row, base, start, slots, first) in enumerate(rows):
        n = len(slots)
        if n == 0:
            continue
        kv = torch.arange(start, start + n, dtype=torch.int64)
        out[0, ID, j] = first
        out[:n, POS, j] = kv + base
        out[:n, ROW, j] = row
        out[:n, LOC, j] = torch.tensor(slots, dtype=torch.int64)
        out[:n, LEN, j] = kv + 1
        out[:n, KV, j] = kv
    return out


class HeadGraphRunner:
    """Captures and replays an EAGLE head's DECODE step (module docstring).

    Args:
        proposer: the ``EagleProposer`` (its head, KV pool, ``req_to_token`` and attention
            backend).
        max_bs: the largest batch captured (``--speculative-max-batch-size``).
        pool: the graph memory pool (the target's: the two never replay at once).
        capture: False: no graphs, every step runs eagerly on the static buffers.
    Raises:
        whatever the capture raises (``engine.device.capture_or_eager`` logs it).
    """

    def __init__(self, proposer, max_bs: int, pool=None, capture: bool = True):
        self.prop = proposer
        head = proposer.head
        self.device_type = proposer.device.type
        self.buckets = batch_size_buckets(max(1, max_bs))
        self.max_bs = self.buckets[-1]
        self.graphs: dict[int, object] = {}
        d, n = proposer.device, self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=d)
        # positions, req_to_token rows and slots (ROW..LOC of pack_chain's tensor, one copy)
        self.meta = torch.zeros(3, n, dtype=torch.int64, device=d)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=d)
        self.hidden = torch.zeros(n, head.hidden_size, dtype=head.dtype, device=d)
        self.drafted = torch.zeros(0, n, dtype=torch.int64, device=d)  # [steps, n]
        self.pool = pool
        self.captured = capture  # the steps read the backend's static graph metadata
        if capture:
            proposer.attn_backend.init_capture(n)
            t0 = time.perf_counter()
            self.capture()
            logger.info("captured %d EAGLE head graphs (bs %s) in %.1f s", len(self.graphs),
                        self.buckets, time.perf_counter() - t0)

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def _step(self, bs: int) -> None:
        """One head DECODE step over the static buffers' first ``bs`` rows; its tokens and
        next hidden states replace the inputs (the next step's)."""
        p = self.prop
        fb = ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, positions=self.meta[0, :bs],
            req_pool_indices=self.meta[1, :bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.meta[2, :bs], req_to_token=p.req_to_token_pool.req_to_token,
            k_buffers=p.kv_pool.k_buffers, v_buffers=p.kv_pool.v_buffers,
            attn_backend=p.attn_backend)
        if self.captured:
            p.attn_backend.init_forward_graph(fb)
        else:
            p.attn_backend.init_forward(fb)
        for_logits, nxt = p.head(self.input_ids[:bs], fb.positions, self.hidden[:bs], fb)
        self.input_ids[:bs].copy_(p.head.greedy(for_logits))
        self.hidden[:bs].copy_(nxt)

    @torch.inference_mode()
    def capture(self) -> None:
        dt = self.device_type
        gcls = dev.graph_class(dt)
        stream = dev.stream_class(dt)()
        dev.synchronize(dt)  # the static buffers' initial values are written
        for bs in reversed(self.buckets):  # largest first so the pool is sized once
            with dev.stream_context(dt, stream):
                for _ in range(2):  # warm up: Triton compiles, the allocator settles
                    self._step(bs)
            dev.synchronize(dt)
            g = gcls()
            with dev.graph_context(dt, g, pool=self.pool, stream=stream):
                self._step(bs)
            self.graphs[bs] = g
        dev.synchronize(dt)

    def run_chain(self, rows: list[tuple[int, int, int, list[int], int]],
                  hidden: torch.Tensor, steps: int) -> list[list[int]]:
        """Run ``steps`` head DECODE steps for ``rows`` (as :func:`pack_chain`'s) from
        ``hidden`` ``[len(rows), hidden]`` (the head's dtype; the rows' next hidden states
        after their first draft token); one host sync.

        Returns:
            per row its ``steps`` drafted target ids (those past its slots are padding's:
            the caller keeps the first ``len(slots)``).
        """
        bs = len(rows)
        gbs = self.buckets[bisect.bisect_left(self.buckets, bs)]
        host = dev.host_to_device(pack_chain(rows, steps, gbs), self.prop.device)
        r2t = self.prop.req_to_token_pool.req_to_token
        # every step's entries at once (padding writes 0 into the sink row 0)
        r2t[host[:, ROW].reshape(-1), host[:, KV].reshape(-1)] = \
            host[:, LOC].reshape(-1).to(torch.int32)
        if self.drafted.shape[0] < steps:
            self.drafted = torch.zeros(steps, self.max_bs, dtype=torch.int64,
                                       device=self.prop.device)
        self.input_ids[:gbs].copy_(host[0, ID])
        self.hidden[:bs].copy_(hidden)
        if gbs > bs:  # the padding rows start from zeros, not a stale (growing) state
            self.hidden[bs:gbs].zero_()
        for s in range(steps):
            self.meta[:, :gbs].copy_(host[s, POS:LEN])
            self.seq_lens[:gbs].copy_(host[s, LEN])
            g = self.graphs.get(gbs)
            if g is not None:
                g.replay()
            else:
                self._step(gbs)
            self.drafted[s, :gbs].copy_(self.input_ids[:gbs])
        return self.drafted[:steps, :bs].t().tolist()


def draft_chain(proposer, runner: HeadGraphRunner, live: list, out: list[list[int]],
                ks: list[int]) -> bool:
    """``ModelProposer.decode_chain`` through ``runner``: every step's KV slots up front,
    then :meth:`HeadGraphRunner.run_chain`; False (nothing done) for a batch past the
    runner's buckets or without hidden states. A request whose slots do not fit in the
    draft pool gets no further drafts this step."""
    if live[0][2] is None or not runner.can_run(len(live)):
        return False
    rows, kept = [], []
    for i, seq, h in live:
        need, start, first = ks[i] - len(out[i]), seq.kv_len, out[i][-1]
        slots = proposer._grow(seq, [first] * need)  # the entries' ids are set below
        if slots is None:
            continue
        rows.append((seq.req_pool_idx, seq.base, start, slots, first))
        kept.append((i, seq, h, start, need))
    if not rows:
        return True
    drafted = runner.run_chain(rows, torch.cat([k[2] for k in kept]),
                               max(k[4] for k in kept))
    for (i, seq, _, start, need), toks in zip(kept, drafted):
        # entry start + s was computed from step s's input: the previous step's draft
        seq.ids[start + 1:start + need] = toks[:need - 1]
        out[i].extend(toks[:need])
    return True


class _CheckReq:
    """The start-up check's request (what ``DraftSeq`` reads of one)."""

    rid = "head-graph-check"
    finished = False
    req_pool_idx = 0


@torch.inference_mode()
def check_head_graphs(proposer, runner: HeadGraphRunner, n: int = 8) -> tuple[bool, str]:
    """Compare one chain step through ``runner`` with the head's eager DECODE step, at
    start-up (as ``engine/executor/graph_setup.py`` does for the target's graphs): one
    request of ``n`` seeded random ids and target states at base 3 is caught up eagerly,
    then its next hidden state is computed both ways and compared with
    ``engine.device.replay_matches_eager`` (the dtype's tolerance).

    Returns:
        ``(agree, detail)``; ``(True, ...)`` when the draft pool has no room for the check.
        The request's KV and ``req_to_token`` row go back to the pool either way.
    """
    from engine.executor.schedule_batch import ScheduleBatch
    from engine.speculative.draft import DraftSeq

    head = proposer.head
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.mc.vocab_size, (n + 1,), generator=g).tolist()
    width = head.fc.weight.shape[1] if head.eagle3 else head.hidden_size
    hidden = torch.randn(n, width, generator=g).to(proposer.device, head.dtype)
    seq = DraftSeq(_CheckReq(), base=3)
    try:
        slots = proposer._grow(seq, ids[:n])
        slot = proposer._grow(seq, ids[n:]) if slots is not None else None
        if slot is None:
            return True, "skipped: the draft pool has no room for it"
        ext = ScheduleBatch(ForwardMode.EXTEND, [seq], [0], [n], [True], slots)
        _, h = proposer.forward(ext, [seq], hidden)
        dec = ScheduleBatch(ForwardMode.DECODE, [seq], [n], [1], [True], slot)
        _, eager = proposer.forward(dec, [seq], h)
        runner.run_chain([(seq.req_pool_idx, seq.base, n, slot, ids[n])], h, 1)
        return dev.replay_matches_eager(runner.hidden[:1], eager, head.dtype)
    finally:
        proposer.kv.release(seq, cache=False)
