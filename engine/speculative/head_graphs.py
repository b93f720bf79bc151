"""Device graphs for an EAGLE head's draft steps (``EagleProposer``).

A round of drafting per request: the catch-up (the head takes in the target's hidden states
of the positions it has not seen: after a verify step, the 1..k + 1 accepted ones), whose
last row gives the first draft token, then one DECODE step of the head per further draft
token. Run eagerly, each of those forwards costs python, ~40 small kernel launches and a
host sync. Here both are captured (head + greedy argmax) and a round runs on the device with
one host sync:

- chain graphs: the head's DECODE step over ``bs`` requests, one per batch-size bucket
  (``batch_size_buckets`` up to ``--speculative-max-batch-size``);
- catch-up graphs: the catch-up of ``R`` rows, one per row bucket (up to
  ``max(64, max_bs * (k + 1))``), run as DECODE rows: row ``j`` of a request sits at KV
  index ``start + j`` of the same ``req_to_token`` row, and every row's K/V is stored before
  attention, so row ``j`` sees exactly the entries ``<= start + j`` (causal, as the verify
  step's decode rows, ``engine/speculative/worker.py``). It gathers each request's last row
  into the chain's inputs. A longer catch-up (a new request's prompt, a return from back-off)
  runs as an eager EXTEND, then the chain graphs;
- the KV slots of every row and step are taken up front (``ModelProposer._grow``), so the
  positions, ``seq_lens``, slots and ``req_to_token`` entries are known before the first
  replay: one host -> device copy (:func:`pack_rows`, :func:`pack_chain`) and one
  ``req_to_token`` write;
- each captured forward writes its tokens and next hidden states into the chain's input
  buffers, so step ``s + 1`` reads what step ``s`` drafted without the host; each step's
  tokens are copied aside (``drafted``) and read with one ``.tolist()``.

Padding rows (a batch padded to its bucket, or a request whose chain ended before the
others') point at ``req_to_token`` row 0 and pool slot 0, the padding sink, as the target's
decode graphs do (``engine/executor/graph_runner.py``).

Positions: the head's KV index ``c`` (``req_to_token`` column, ``seq_lens``) is relative to
the request's ``DraftSeq.base``; its rotary position is ``base + c``.

Without graphs (``capture=False``: the CPU tests) the same forwards run eagerly on the same
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
    # python lists, one tensor at the end (a few us; torch ops per entry cost ~100x that)
    flat = ([0] * (LEN * gbs) + [1] * gbs + [0] * gbs) * steps
    for j, (row, base, start, slots, first) in enumerate(rows):
        if slots:
            flat[ID * gbs + j] = first
        for s, loc in enumerate(slots):
            o, c = s * 6 * gbs + j, start + s
            flat[o + POS * gbs], flat[o + ROW * gbs], flat[o + LOC * gbs] = base + c, row, loc
            flat[o + LEN * gbs], flat[o + KV * gbs] = c + 1, c
    return torch.tensor(flat, dtype=torch.int64).view(steps, 6, gbs)


def pack_rows(reqs: list[tuple[int, int, int, list[int], list[int]]], rb: int,
              nlast: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The host side of a catch-up run as DECODE rows, padded to ``rb`` rows.

    Args:
        reqs: per request ``(req_pool_idx, base, kv_start, slots, ids)``: its rows are
            ``ids[j]`` at KV index ``kv_start + j`` in slot ``slots[j]``.
        rb: the padded row count (``>=`` the rows); nlast: the length of the last-row index
            (``>= len(reqs)``).
    Returns:
        ``rows`` int64 ``[6, rb]`` laid out as one step of :func:`pack_chain` (``ID``,
        ``POS`` = ``base + kv_start + j``, ``ROW``, ``LOC``, ``LEN`` = ``kv_start + j + 1``,
        ``KV``; padding ``(0, 0, 0, 0, 1, 0)``), and ``last`` int64 ``[nlast]``: each
        request's last row (0 past ``len(reqs)``).
    Raises:
        ValueError: more rows than ``rb``, more requests than ``nlast``, or a request whose
            slots and ids differ in number.
    """
    n = sum(len(r[4]) for r in reqs)
    if n > rb or len(reqs) > nlast or any(len(r[3]) != len(r[4]) for r in reqs):
        raise ValueError(f"{n} rows of {len(reqs)} requests for {rb} rows and {nlast} "
                         "requests, or slots and ids of different lengths")
    flat = [0] * (LEN * rb) + [1] * rb + [0] * rb
    last = [0] * nlast
    off = 0
    for j, (row, base, start, slots, ids) in enumerate(reqs):
        for t, (loc, tok) in enumerate(zip(slots, ids)):
            o, c = off + t, start + t
            flat[o + ID * rb], flat[o + POS * rb], flat[o + ROW * rb] = tok, base + c, row
            flat[o + LOC * rb], flat[o + LEN * rb], flat[o + KV * rb] = loc, c + 1, c
        off += len(ids)
        last[j] = off - 1
    return (torch.tensor(flat, dtype=torch.int64).view(6, rb),
            torch.tensor(last, dtype=torch.int64))


class HeadGraphRunner:
    """Captures and replays an EAGLE head's chain and catch-up forwards (module docstring).

    Args:
        proposer: the ``EagleProposer`` (its head, KV pool, ``req_to_token`` and attention
            backend).
        max_bs: the largest batch captured (``--speculative-max-batch-size``).
        max_rows: the most catch-up rows captured (0: no catch-up graphs).
        pool: the graph memory pool (the target's: the two never replay at once).
        capture: False: no graphs, every forward runs eagerly on the static buffers.
    Raises:
        whatever the capture raises (``engine.device.capture_or_eager`` logs it).
    """

    def __init__(self, proposer, max_bs: int, max_rows: int = 0, pool=None,
                 capture: bool = True):
        self.prop = proposer
        head = proposer.head
        self.device_type = proposer.device.type
        self.buckets = batch_size_buckets(max(1, max_bs))
        self.max_bs = self.buckets[-1]
        self.row_buckets = batch_size_buckets(max_rows) if max_rows > 0 else []
        self.max_rows = self.row_buckets[-1] if self.row_buckets else 0
        self.graphs: dict[int, object] = {}  # chain steps, by batch size
        self.row_graphs: dict[int, object] = {}  # catch-ups, by row count
        d, n, rm = proposer.device, self.max_bs, max(1, self.max_rows)
        # the chain step's inputs: ids, (positions, req_to_token rows, slots), seq_lens,
        # hidden states (the head's own: width hidden)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=d)
        self.meta = torch.zeros(3, n, dtype=torch.int64, device=d)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=d)
        self.hidden = torch.zeros(n, head.hidden_size, dtype=head.dtype, device=d)
        # the catch-up's: the same per row, the target's states, each request's last row
        self.row_ids = torch.zeros(rm, dtype=torch.int64, device=d)
        self.row_meta = torch.zeros(3, rm, dtype=torch.int64, device=d)
        self.row_lens = torch.ones(rm, dtype=torch.int32, device=d)
        self.row_hidden = torch.zeros(rm, hidden_in_width(head), dtype=head.dtype, device=d)
        self.last = torch.zeros(n, dtype=torch.int64, device=d)
        self.drafted = torch.zeros(0, n, dtype=torch.int64, device=d)  # [steps, n]
        self.pool = pool
        self.captured = capture  # the forwards read the backend's static graph metadata
        if capture:
            proposer.attn_backend.init_capture(max(n, self.max_rows))
            t0 = time.perf_counter()
            self.capture()
            logger.info("captured %d EAGLE head graphs (chain bs %s, catch-up rows %s) in "
                        "%.1f s", len(self.graphs) + len(self.row_graphs), self.buckets,
                        self.row_buckets, time.perf_counter() - t0)

    def can_run(self, bs: int, rows: int = 0) -> bool:
        """Whether a chain of ``bs`` requests (and a catch-up of ``rows`` rows) fits."""
        return bs <= self.max_bs and rows <= self.max_rows

    def _forward(self, n: int, ids, meta, lens, hidden, last=None) -> None:
        """One head forward as ``n`` DECODE rows over static buffers; the greedy tokens and
        next hidden states of its rows (of rows ``last`` when given) go into the chain's
        inputs (the next step's)."""
        p = self.prop
        fb = ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=n, positions=meta[0, :n],
            req_pool_indices=meta[1, :n], seq_lens=lens[:n], out_cache_loc=meta[2, :n],
            req_to_token=p.req_to_token_pool.req_to_token, k_buffers=p.kv_pool.k_buffers,
            v_buffers=p.kv_pool.v_buffers, attn_backend=p.attn_backend)
        if self.captured:
            p.attn_backend.init_forward_graph(fb)
        else:
            p.attn_backend.init_forward(fb)
        for_logits, nxt = p.head(ids[:n], fb.positions, hidden[:n], fb)
        if last is not None:
            for_logits, nxt = for_logits.index_select(0, last), nxt.index_select(0, last)
        m = nxt.shape[0]
        self.input_ids[:m].copy_(p.head.greedy(for_logits))
        self.hidden[:m].copy_(nxt)

    def _step(self, bs: int) -> None:
        self._forward(bs, self.input_ids, self.meta, self.seq_lens, self.hidden)

    def _catch_up(self, rows: int) -> None:
        self._forward(rows, self.row_ids, self.row_meta, self.row_lens, self.row_hidden,
                      self.last)

    @torch.inference_mode()
    def capture(self) -> None:
        dt = self.device_type
        gcls = dev.graph_class(dt)
        stream = dev.stream_class(dt)()
        dev.synchronize(dt)  # the static buffers' initial values are written
        # largest first so the pool is sized once
        todo = [(self.row_graphs, r, self._catch_up) for r in reversed(self.row_buckets)]
        todo += [(self.graphs, b, self._step) for b in reversed(self.buckets)]
        for graphs, size, fn in todo:
            with dev.stream_context(dt, stream):
                for _ in range(2):  # warm up: Triton compiles, the allocator settles
                    fn(size)
            dev.synchronize(dt)
            g = gcls()
            with dev.graph_context(dt, g, pool=self.pool, stream=stream):
                fn(size)
            graphs[size] = g
        dev.synchronize(dt)

    def _run(self, graphs: dict, size: int, fn) -> None:
        g = graphs.get(size)
        if g is not None:
            g.replay()
        else:
            fn(size)

    def _chain(self, chain: torch.Tensor, steps: int, gbs: int, first: int) -> None:
        """The chain's steps from the device copy of :func:`pack_chain`'s tensor; step
        ``s``'s tokens into ``drafted[first + s]``."""
        for s in range(steps):
            self.meta[:, :gbs].copy_(chain[s, POS:LEN])
            self.seq_lens[:gbs].copy_(chain[s, LEN])
            self._run(self.graphs, gbs, self._step)
            self.drafted[first + s, :gbs].copy_(self.input_ids[:gbs])

    def _upload(self, parts: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
        """``parts`` (host int64) on the device in one copy, and room for ``steps`` rows of
        drafted tokens."""
        if self.drafted.shape[0] < steps:
            self.drafted = torch.zeros(steps, self.max_bs, dtype=torch.int64,
                                       device=self.prop.device)
        flat = dev.host_to_device(torch.cat([t.reshape(-1) for t in parts]), self.prop.device)
        return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in parts]), parts)]

    def _write_req_to_token(self, *packs: torch.Tensor) -> None:
        """Every row's and step's ``req_to_token`` entry at once (padding writes 0 into the
        sink row 0)."""
        r2t = self.prop.req_to_token_pool.req_to_token
        cat = [torch.cat([p[..., i, :].reshape(-1) for p in packs]) for i in (ROW, KV, LOC)]
        r2t[cat[0], cat[1]] = cat[2].to(torch.int32)

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
        (chain,) = self._upload([pack_chain(rows, steps, gbs)], steps)
        self._write_req_to_token(chain)
        self.input_ids[:gbs].copy_(chain[0, ID])
        self.hidden[:bs].copy_(hidden)
        if gbs > bs:  # the padding rows start from zeros, not a stale (growing) state
            self.hidden[bs:gbs].zero_()
        self._chain(chain, steps, gbs, 0)
        return self.drafted[:steps, :bs].t().tolist()

    def run_round(self, reqs: list[tuple[int, int, int, list[int], list[int]]],
                  hidden: torch.Tensor, chain: list[tuple[int, int, int, list[int], int]],
                  steps: int) -> list[list[int]]:
        """A whole round: the catch-up of ``reqs`` (as :func:`pack_rows`'s) from the
        target's states ``hidden`` ``[rows, hidden_in_width(head)]``, then ``steps`` chain
        steps for ``chain`` (as :func:`pack_chain`'s, the same requests in the same order;
        their first ids come from the catch-up); one host sync.

        Returns:
            per request ``1 + steps`` target ids: the first draft, then the chain's.
        """
        bs, n = len(reqs), hidden.shape[0]
        gbs = self.buckets[bisect.bisect_left(self.buckets, bs)]
        rb = self.row_buckets[bisect.bisect_left(self.row_buckets, n)]
        rows, last = pack_rows(reqs, rb, self.max_bs)
        rows, last, ch = self._upload([rows, last, pack_chain(chain, max(1, steps), gbs)],
                                      1 + steps)
        self._write_req_to_token(rows, ch)
        self.row_ids[:rb].copy_(rows[ID])
        self.row_meta[:, :rb].copy_(rows[POS:LEN])
        self.row_lens[:rb].copy_(rows[LEN])
        self.row_hidden[:n].copy_(hidden)
        self.last.copy_(last)
        self._run(self.row_graphs, rb, self._catch_up)
        self.drafted[0, :gbs].copy_(self.input_ids[:gbs])
        self._chain(ch, steps, gbs, 1)
        return self.drafted[:1 + steps, :bs].t().tolist()


def hidden_in_width(head) -> int:
    """The width of the target states a catch-up feeds the head: 3 x the target's hidden
    size (EAGLE-3's low/mid/high), else the hidden size."""
    return head.fc.weight.shape[1] if head.eagle3 else head.hidden_size


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


def draft_round(proposer, runner: HeadGraphRunner, work: list, out: list[list[int]],
                ks: list[int]) -> bool:
    """``ModelProposer.draft_round`` through ``runner``: every catch-up row's and chain
    step's KV slots up front, then :meth:`HeadGraphRunner.run_round`; False (nothing done)
    without hidden states, or for a batch or catch-up past the captured buckets. As eagerly,
    a request whose catch-up does not fit in the draft pool gets no drafts this step; one
    whose chain does not fit gets only its first draft."""
    if work[0][3] is None or not runner.can_run(len(work), sum(len(w[2]) for w in work)):
        return False
    reqs, chain, kept, hid = [], [], [], []
    for i, seq, ids, hs in work:
        start = seq.kv_len
        slots = proposer._grow(seq, ids)
        if slots is None:
            continue
        more = (proposer._grow(seq, [0] * (ks[i] - 1)) if ks[i] > 1 else None) or []
        c0 = start + len(ids)
        reqs.append((seq.req_pool_idx, seq.base, start, slots, ids))
        chain.append((seq.req_pool_idx, seq.base, c0, more, 0))
        kept.append((i, seq, c0, len(more)))
        hid.append(hs)
    if not kept:
        return True
    drafted = runner.run_round(reqs, torch.cat(hid), chain, max(k[3] for k in kept))
    for (i, seq, c0, m), toks in zip(kept, drafted):
        seq.ids[c0:c0 + m] = toks[:m]  # chain entry c0 + s was computed from draft s
        out[i].extend(toks[:1 + m])
    return True


class _CheckReq:
    """The start-up check's request (what ``DraftSeq`` reads of one)."""

    rid = "head-graph-check"
    finished = False
    req_pool_idx = 0


@torch.inference_mode()
def check_head_graphs(proposer, runner: HeadGraphRunner, n: int = 8) -> tuple[bool, str]:
    """Compare the captured forwards with the head's eager ones at start-up (as
    ``engine/executor/graph_setup.py`` does for the target's graphs): one request of ``n``
    seeded random ids and target states at base 3; its catch-up (an eager EXTEND against
    the catch-up graph) and one chain step after it (an eager DECODE against the chain
    graph), each one's next hidden state compared with
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
    hidden = torch.randn(n, hidden_in_width(head), generator=g).to(proposer.device,
                                                                   head.dtype)
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
        row, results = seq.req_pool_idx, []
        if runner.can_run(1, n):
            runner.run_round([(row, seq.base, 0, slots, ids[:n])], hidden,
                             [(row, seq.base, n, [], 0)], 0)
            results.append(("catch-up", *dev.replay_matches_eager(runner.hidden[:1], h,
                                                                  head.dtype)))
        runner.run_chain([(row, seq.base, n, slot, ids[n])], h, 1)
        results.append(("chain", *dev.replay_matches_eager(runner.hidden[:1], eager,
                                                           head.dtype)))
        return (all(ok for _, ok, _ in results),
                "; ".join(f"{what}: {detail}" for what, _, detail in results))
    finally:
        proposer.kv.release(seq, cache=False)
