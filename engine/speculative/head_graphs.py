"""Device graphs for an EAGLE head's draft steps (``EagleProposer``).

A round of drafting per request: the catch-up (the head takes in the target's hidden states
of the positions it has not seen: after a verify step, the 1..k + 1 accepted ones), whose
last row gives the first draft token, then one DECODE step of the head per further draft
token. Run eagerly, each of those forwards costs python, ~40 small kernel launches and a
host sync. Here both are captured (head + greedy argmax) and a round runs on the device with
one host sync:

- step graphs: one DECODE step of the head over ``bs`` requests, one per batch-size bucket
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
  replay: packed on the host (``engine/speculative/head_packing.py``) and copied in one
  host -> device copy into a static upload buffer at fixed offsets; the graphs read their
  inputs from it and write their ``req_to_token`` entries themselves;
- each captured forward writes its tokens and next hidden states into the chain's input
  buffers, so step ``s + 1`` reads what step ``s`` drafted without the host; each step's
  tokens are copied aside (``drafted``) inside the graph and read with one ``.tolist()``;
- chain graphs of the usual length (``--speculative-num-steps - 1`` steps, one per batch
  bucket): a round is then the upload, a copy of the target's states, two replays and the
  ``.tolist()``. A chain of another length replays the one-step graph per step, its inputs
  copied in eagerly before each.

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
from engine.speculative.head_packing import (
    ID,
    KV,
    LEN,
    LOC,
    POS,
    ROW,
    chain_flat,
    rows_flat,
)

logger = logging.getLogger(__name__)

class HeadGraphRunner:
    """Captures and replays an EAGLE head's catch-up and chain forwards (module docstring).

    Args:
        proposer: the ``EagleProposer`` (its head, KV pool, ``req_to_token`` and attention
            backend).
        max_bs: the largest batch captured (``--speculative-max-batch-size``).
        max_rows: the most catch-up rows captured (0: no catch-up graphs).
        pool: the graph memory pool (the target's: the two never replay at once).
        capture: False: no graphs, every forward runs eagerly on the static buffers.
        steps: the chain's usual length (``--speculative-num-steps - 1``): a chain of that
            many steps is one graph per batch bucket; another length (up to
            ``max(1, steps)``) replays the one-step graphs.
    Raises:
        whatever the capture raises (``engine.device.capture_or_eager`` logs it).
    """

    def __init__(self, proposer, max_bs: int, max_rows: int = 0, pool=None,
                 capture: bool = True, steps: int = 1):
        self.prop = proposer
        head = proposer.head
        self.device_type = proposer.device.type
        self.buckets = batch_size_buckets(max(1, max_bs))
        self.max_bs = self.buckets[-1]
        self.row_buckets = batch_size_buckets(max_rows) if max_rows > 0 else []
        self.max_rows = self.row_buckets[-1] if self.row_buckets else 0
        self.steps, self.max_steps = steps, max(1, steps)
        self.graphs: dict[int, object] = {}  # one chain step, by batch size
        self.chain_graphs: dict[int, object] = {}  # chains of ``steps`` steps, by batch size
        self.row_graphs: dict[int, object] = {}  # catch-ups, by row count
        d, n, rm, sm = proposer.device, self.max_bs, max(1, self.max_rows), self.max_steps
        # the upload (int64): the catch-up's rows [6, rb] at 0 (the region holds [6, rm]),
        # their last rows [n] at 6 * rm, the chain [steps, 6, gbs] at chain_at (the region
        # holds [sm, 6, n]); each graph reads its bucket's view. Written on the host into a
        # pinned twin and copied over in one copy; every run ends with a host sync, so the
        # twin is free again when the next run writes it.
        self.last_at, self.chain_at = 6 * rm, 6 * rm + n
        self.up = torch.zeros(self.chain_at + sm * 6 * n, dtype=torch.int64, device=d)
        self.host_up = torch.zeros_like(self.up, device="cpu")
        if d.type != "cpu":
            self.host_up = self.host_up.pin_memory()
        self.host_np = self.host_up.numpy()
        self.last_up = self.up[self.last_at:self.chain_at]
        # the chain step's inputs: ids, (positions, req_to_token rows, slots), seq_lens,
        # hidden states (the head's own: width hidden)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=d)
        self.meta = torch.zeros(3, n, dtype=torch.int64, device=d)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=d)
        self.hidden = torch.zeros(n, head.hidden_size, dtype=head.dtype, device=d)
        # the catch-up's seq_lens and target states (its ids and meta: the upload's)
        self.row_lens = torch.ones(rm, dtype=torch.int32, device=d)
        self.row_hidden = torch.zeros(rm, hidden_in_width(head), dtype=head.dtype, device=d)
        # the drafted tokens: the catch-up's [0], chain step s's [1 + s]
        self.drafted = torch.zeros(1 + sm, n, dtype=torch.int64, device=d)
        self.pool = pool
        self.captured = capture  # the forwards read the backend's static graph metadata
        if capture:
            proposer.attn_backend.init_capture(max(n, self.max_rows))
            t0 = time.perf_counter()
            self.capture()
            logger.info("captured %d EAGLE head graphs (chain bs %s, one step and %d steps; "
                        "catch-up rows %s) in %.1f s", len(self.graphs) +
                        len(self.chain_graphs) + len(self.row_graphs), self.buckets,
                        self.steps, self.row_buckets, time.perf_counter() - t0)

    def can_run(self, bs: int, rows: int = 0, steps: int = 0) -> bool:
        """Whether a chain of ``bs`` requests and ``steps`` steps (and a catch-up of
        ``rows`` rows) fits."""
        return bs <= self.max_bs and rows <= self.max_rows and steps <= self.max_steps

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

    def _rows_up(self, rows: int) -> torch.Tensor:
        return self.up[:6 * rows].view(6, rows)

    def _chain_up(self, steps: int, bs: int) -> torch.Tensor:
        return self.up[self.chain_at:self.chain_at + steps * 6 * bs].view(steps, 6, bs)

    def _upload(self, parts: list[tuple[int, list[int]]]) -> None:
        """Each ``(offset, ints)`` of ``parts`` into the pinned twin, then the span up to
        the last one's end onto the device in one copy (not blocking the host)."""
        for at, ints in parts:
            self.host_np[at:at + len(ints)] = ints
        lo, hi = parts[0][0], parts[-1][0] + len(parts[-1][1])
        self.up[lo:hi].copy_(self.host_up[lo:hi], non_blocking=True)

    def _write_req_to_token(self, pack: torch.Tensor) -> None:
        """The ``req_to_token`` entries of ``pack`` (``[..., 6, width]``, a view of the
        upload) in one write; padding writes 0 into the sink row 0."""
        r2t = self.prop.req_to_token_pool.req_to_token
        r2t[pack[..., ROW, :], pack[..., KV, :]] = pack[..., LOC, :].to(r2t.dtype)

    def _step(self, bs: int) -> None:
        """One chain step over ``meta`` and ``seq_lens`` (written before each replay)."""
        self._forward(bs, self.input_ids, self.meta, self.seq_lens, self.hidden)

    def _catch_up(self, rows: int) -> None:
        """The catch-up of ``rows`` rows from the upload: its ``req_to_token`` entries, the
        forward, each request's last row's token into ``drafted[0]``."""
        up = self._rows_up(rows)
        self._write_req_to_token(up)
        self.row_lens[:rows].copy_(up[LEN])
        self._forward(rows, up[ID], up[POS:LEN], self.row_lens, self.row_hidden,
                      self.last_up)
        self.drafted[0].copy_(self.input_ids)

    def _chain_steps(self, bs: int) -> None:
        """A chain of ``steps`` steps from the upload: its ``req_to_token`` entries, then
        per step its positions, ``seq_lens``, the forward, its tokens into ``drafted``."""
        up = self._chain_up(self.steps, bs)
        self._write_req_to_token(up)
        for s in range(self.steps):
            self.seq_lens[:bs].copy_(up[s, LEN])
            self._forward(bs, self.input_ids, up[s, POS:LEN], self.seq_lens, self.hidden)
            self.drafted[1 + s, :bs].copy_(self.input_ids[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        dt = self.device_type
        gcls = dev.graph_class(dt)
        stream = dev.stream_class(dt)()
        dev.synchronize(dt)  # the static buffers' initial values are written
        # largest first so the pool is sized once
        todo = [(self.row_graphs, r, self._catch_up) for r in reversed(self.row_buckets)]
        todo += [(self.chain_graphs, b, self._chain_steps) for b in reversed(self.buckets)
                 if self.steps > 0]
        todo += [(self.graphs, b, self._step) for b in reversed(self.buckets)]
        for graphs, size, fn in todo:
            # the warm-up runs read padding (seq_len 1), not zeros; last rows 0
            rows = rows_flat([], size, 1)[0] if graphs is self.row_graphs else []
            self._upload([(0, rows), (self.chain_at, chain_flat([], self.max_steps,
                                                                 min(size, self.max_bs)))])
            dev.synchronize(dt)
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

    def _chain(self, steps: int, gbs: int) -> None:
        """The chain's ``steps`` steps from the upload; step ``s``'s tokens into
        ``drafted[1 + s]``: one replay when ``steps`` is the captured chain's, else the
        one-step graph per step with its inputs copied in before."""
        if steps == 0:
            return
        if steps == self.steps:
            self._run(self.chain_graphs, gbs, self._chain_steps)
            return
        up = self._chain_up(steps, gbs)
        self._write_req_to_token(up)
        for s in range(steps):
            self.meta[:, :gbs].copy_(up[s, POS:LEN])
            self.seq_lens[:gbs].copy_(up[s, LEN])
            self._run(self.graphs, gbs, self._step)
            self.drafted[1 + s, :gbs].copy_(self.input_ids[:gbs])

    def _drafts(self, lo: int, hi: int, bs: int) -> list[list[int]]:
        """``drafted`` rows ``lo:hi`` per request (the first ``bs``): one device -> host
        copy of contiguous rows (a transposed view would cost a device copy first)."""
        return [list(col) for col in zip(*self.drafted[lo:hi].tolist())][:bs]

    def _check(self, bs: int, rows: int, steps: int) -> None:
        if not self.can_run(bs, rows, steps):
            raise ValueError(f"{bs} requests, {rows} rows, {steps} steps: past the buckets "
                             f"({self.max_bs}, {self.max_rows}, {self.max_steps})")

    def run_chain(self, rows: list[tuple[int, int, int, list[int], int]],
                  hidden: torch.Tensor, steps: int) -> list[list[int]]:
        """Run ``steps`` head DECODE steps for ``rows`` (as ``head_packing.pack_chain``'s)
        from ``hidden`` ``[len(rows), hidden]`` (the head's dtype; the rows' next hidden
        states after their first draft token); one host sync.

        Returns:
            per row its ``steps`` drafted target ids (those past its slots are padding's:
            the caller keeps the first ``len(slots)``).
        Raises:
            ValueError: past :meth:`can_run`.
        """
        bs = len(rows)
        self._check(bs, 0, steps)
        gbs = self.buckets[bisect.bisect_left(self.buckets, bs)]
        if steps == 0:
            return [[] for _ in rows]
        self._upload([(self.chain_at, chain_flat(rows, steps, gbs))])
        self.input_ids[:gbs].copy_(self._chain_up(steps, gbs)[0, ID])
        self.hidden[:bs].copy_(hidden)
        if gbs > bs:  # the padding rows start from zeros, not a stale (growing) state
            self.hidden[bs:gbs].zero_()
        self._chain(steps, gbs)
        return self._drafts(1, 1 + steps, bs)

    def run_round(self, reqs: list[tuple[int, int, int, list[int], list[int]]],
                  hidden: torch.Tensor, chain: list[tuple[int, int, int, list[int], int]],
                  steps: int) -> list[list[int]]:
        """A whole round: the catch-up of ``reqs`` (as ``head_packing.pack_rows``'s) from
        the target's states ``hidden`` ``[rows, hidden_in_width(head)]``, then ``steps``
        chain steps for ``chain`` (as ``head_packing.pack_chain``'s, the same requests in
        the same order; their first ids come from the catch-up); one host -> device copy,
        two replays (for a chain of the usual length) and one host sync.

        Returns:
            per request ``1 + steps`` target ids: the first draft, then the chain's.
        Raises:
            ValueError: past :meth:`can_run`.
        """
        bs, n = len(reqs), hidden.shape[0]
        self._check(bs, n, steps)
        gbs = self.buckets[bisect.bisect_left(self.buckets, bs)]
        rb = self.row_buckets[bisect.bisect_left(self.row_buckets, n)]
        rows, last = rows_flat(reqs, rb, self.max_bs)
        self._upload([(0, rows), (self.last_at, last),
                      (self.chain_at, chain_flat(chain, steps, gbs))])
        self.row_hidden[:n].copy_(hidden)
        self._run(self.row_graphs, rb, self._catch_up)
        self._chain(steps, gbs)
        return self._drafts(0, 1 + steps, bs)


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
    if live[0][2] is None or not runner.can_run(
            len(live), 0, max(ks[i] - len(out[i]) for i, _, _ in live)):
        return False
    rows, kept = [], []
    for i, seq, h in live:
        need, start, first = ks[i] - len(out[i]), seq.kv_len, out[i][-1]
        slots = proposer._grow(seq, [first] * need) if need > 0 else None  # ids set below
        if slots is None:  # no room, or its chain is complete
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
    if work[0][3] is None or not runner.can_run(len(work), sum(len(w[2]) for w in work),
                                                max(ks[w[0]] for w in work) - 1):
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
    drafted = runner.run_round(reqs, hid[0] if len(hid) == 1 else torch.cat(hid), chain,
                               max(k[3] for k in kept))
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
    seeded random ids and target states at base 3. Its catch-up alone (the catch-up graph
    against an eager EXTEND); a whole round with a chain of the runner's ``steps`` (the
    chain graph against the EXTEND and ``steps`` eager DECODE steps fed with the round's
    own drafts); one chain step (the one-step graph against an eager DECODE step). Each
    one's last hidden state is compared with ``engine.device.replay_matches_eager`` (the
    dtype's tolerance).

    Returns:
        ``(agree, detail)``; ``(True, ...)`` when the draft pool has no room for the check.
        The request's KV and ``req_to_token`` row go back to the pool either way.
    """
    from engine.executor.schedule_batch import ScheduleBatch
    from engine.speculative.draft import DraftSeq

    head, sm = proposer.head, runner.max_steps
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.mc.vocab_size, (n + sm,), generator=g).tolist()
    hidden = torch.randn(n, hidden_in_width(head), generator=g).to(proposer.device,
                                                                   head.dtype)
    seq = DraftSeq(_CheckReq(), base=3)

    def eager(feed: list[int]) -> torch.Tensor:
        """The EXTEND, then a DECODE step per id of ``feed``: the last hidden state."""
        ext = ScheduleBatch(ForwardMode.EXTEND, [seq], [0], [n], [True], slots)
        _, h = proposer.forward(ext, [seq], hidden)
        for s, tok in enumerate(feed):
            seq.ids[n + s] = tok
            dec = ScheduleBatch(ForwardMode.DECODE, [seq], [n + s], [1], [True], [more[s]])
            _, h = proposer.forward(dec, [seq], h)
        return h

    def compare(what: str, want: torch.Tensor) -> None:
        results.append((what, *dev.replay_matches_eager(runner.hidden[:1], want, head.dtype)))

    try:
        slots = proposer._grow(seq, ids[:n])
        more = proposer._grow(seq, ids[n:]) if slots is not None else None
        if more is None:
            return True, "skipped: the draft pool has no room for it"
        row, results = seq.req_pool_idx, []
        if runner.can_run(1, n):
            runner.run_round([(row, seq.base, 0, slots, ids[:n])], hidden,
                             [(row, seq.base, n, [], 0)], 0)
            compare("catch-up", eager([]))
            if runner.steps:
                drafts = runner.run_round([(row, seq.base, 0, slots, ids[:n])], hidden,
                                          [(row, seq.base, n, more[:runner.steps], 0)],
                                          runner.steps)[0]
                compare(f"round of {runner.steps} steps", eager(drafts[:runner.steps]))
        h = eager([])
        want = eager(ids[n:n + 1])
        runner.run_chain([(row, seq.base, n, more[:1], ids[n])], h, 1)
        compare("chain", want)
        return (all(ok for _, ok, _ in results),
                "; ".join(f"{what}: {detail}" for what, _, detail in results))
    finally:
        proposer.kv.release(seq, cache=False)
