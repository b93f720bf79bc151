"""What the model proposers (STANDALONE, EAGLE, EAGLE-3) share: a draft KV cache of their
own, kept in step with each request's accepted tokens, and the propose loop.

A model proposer drafts a chain greedily: one catch-up EXTEND over what the draft has not
seen yet (a new request's prompt, in chunks of ``--chunked-prefill-size``; after a verify
step, the accepted tokens), whose last row gives the first draft token, then one batched
DECODE per further draft token. Its KV lives in its own pool and ``req_to_token`` (same
page size as the target's, no prefix cache): :class:`DraftSeq` is a request's row there.

The KV is indexed from ``base``: KV entry ``c`` is the draft's state at position
``base + c`` (0 for a draft model; an EAGLE head starts where the target's hidden states
it saw start, past a radix-cache prefix). RoPE takes the real positions.

After a verify step (:meth:`ModelProposer.trim`) the draft keeps only what belongs to the
accepted tokens; entries of rejected drafts go back to its pool at once. A request that
ended, was aborted or preempted loses its draft KV at the next step (:meth:`sweep`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import ForwardMode
from engine.kv.manager import KVCacheManager
from engine.speculative.proposer import Proposer

logger = logging.getLogger(__name__)


class DraftSeq:
    """A request's state in the draft: its ``req_to_token`` row and pages (the fields
    ``KVCacheManager`` reads), the input ids of its KV entries (``ids[c]`` is what entry
    ``c`` was computed from), and, for EAGLE, the target's hidden states not yet fed in."""

    __slots__ = ("req", "req_pool_idx", "pages", "cached_pages", "last_node", "kv_len",
                 "ids", "base", "hidden", "hidden_start", "hidden_rows", "swa_pages", "swa_lo")

    def __init__(self, req, base: int = 0):
        self.req = req
        self.req_pool_idx: int | None = None
        self.pages: list[int] = []
        self.cached_pages = 0
        self.last_node = None
        self.kv_len = 0
        # the windowed pool's pages (engine/kv/windowed.py): a draft has none, but
        # KVCacheManager reads them from every sequence it manages
        self.swa_pages: list[int] = []
        self.swa_lo = 0
        self.ids: list[int] = []
        self.base = base
        # EAGLE: target hidden states of positions [hidden_start, hidden_start + hidden_rows)
        self.hidden: list[torch.Tensor] = []
        self.hidden_start = base
        self.hidden_rows = 0

    def tokens(self, start: int, count: int) -> list[int]:
        return self.ids[start:start + count]

    def token_at(self, pos: int) -> int:
        return self.ids[pos]


def draft_pool_tokens(args, target) -> int:
    """Tokens of a draft's KV pool: what the requests of a speculative step can hold
    (``--speculative-max-batch-size`` requests of the whole context plus a chain each),
    at most the target's pool. Requests outside the step lose their draft state when the
    pool is short (``ModelProposer._evict_idle``)."""
    from engine.args import num_draft_tokens

    per = target.max_context_len + num_draft_tokens(args) + args.page_size
    return min(target.max_total_tokens, args.speculative_max_batch_size * per)


class ModelProposer(Proposer):
    """A proposer with a draft forward (subclasses: ``StandaloneProposer``,
    ``EagleProposer``) over its own KV pool.

    Args:
        kv_pool, req_pool: the draft's ``KVPool`` and ``ReqToTokenPool``.
        chunk: catch-up tokens per draft forward (the target's prefill budget).
    """

    def __init__(self, kv_pool, req_pool, chunk: int):
        self.kv = KVCacheManager(kv_pool, req_pool, disable_cache=True)
        self.req_pool = req_pool
        self.chunk = max(1, chunk)
        self.seqs: dict[str, DraftSeq] = {}
        self._active: set[str] = set()  # the rids being drafted for (kept by _evict_idle)

    # ---- the draft's KV -----------------------------------------------------------------
    def drop(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.kv.release(seq, cache=False)

    def sweep(self) -> None:
        """Free the draft KV of requests that ended, or were preempted (no target KV)."""
        for rid in [rid for rid, s in self.seqs.items()
                    if s.req.finished or s.req.req_pool_idx is None]:
            self.drop(rid)

    def observe(self, batch) -> None:
        # after every target step (cheap: one pass over the requests with draft state), so
        # requests that end while batches are too large to speculate do not keep their KV
        self.sweep()

    def truncate(self, seq: DraftSeq, n: int) -> None:
        """Keep the first ``n`` KV entries of ``seq`` (0: all of its pages go back)."""
        if n < seq.kv_len:
            self.kv.shrink(seq, n)
            del seq.ids[n:]

    def reset(self, seq: DraftSeq, base: int) -> None:
        """Drop every KV entry and pending hidden state; start again at position ``base``."""
        self.truncate(seq, 0)
        seq.base = seq.hidden_start = base
        seq.hidden, seq.hidden_rows = [], 0

    def _grow(self, seq: DraftSeq, ids: list[int]) -> list[int] | None:
        """Slots for ``ids`` as ``seq``'s next KV entries; None (nothing taken) if no room
        even after dropping the draft state of the requests that are not drafting now."""
        if seq.req_pool_idx is None:
            seq.req_pool_idx = self.req_pool.alloc()
            if seq.req_pool_idx is None and self._evict_idle():
                seq.req_pool_idx = self.req_pool.alloc()
            if seq.req_pool_idx is None:
                return None
        slots = self.kv.grow(seq, len(ids))
        if slots is None and self._evict_idle():
            slots = self.kv.grow(seq, len(ids))
        if slots is not None:
            seq.ids.extend(ids)
            seq.kv_len += len(ids)
        return slots

    def _evict_idle(self) -> bool:
        """Drop the draft state of requests outside the step being drafted (they ran in
        batches too large to speculate); whether anything was freed."""
        idle = [rid for rid in self.seqs if rid not in self._active]
        for rid in idle:
            self.drop(rid)
        return bool(idle)

    def used_tokens(self) -> int:
        """Draft KV tokens held (whole pages), for the accounting tests."""
        return self.kv.used_tokens()

    def check(self) -> None:
        """Assert the draft pool's page accounting: free + held by the requests' draft
        state = the pool, no page twice (``KVCacheManager.check``)."""
        self.kv.check(list(self.seqs.values()))
        for seq in self.seqs.values():
            assert len(seq.ids) == seq.kv_len, "draft ids and KV length disagree"

    # ---- what a subclass provides --------------------------------------------------------
    def catch_up(self, seq: DraftSeq, req) -> tuple[list[int], torch.Tensor | None] | None:
        """The input ids (and, for EAGLE, hidden-state rows) of the KV entries ``seq`` lacks
        before drafting for ``req``, after any truncation; None: no draft for it now."""
        raise NotImplementedError

    def forward(self, batch: ScheduleBatch, seqs: list[DraftSeq],
                hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the draft over ``batch``; returns the greedy next token of each request's
        last row ``[B]`` int64 (target ids) and, for EAGLE, those rows' hidden states."""
        raise NotImplementedError

    def after_propose(self, seq: DraftSeq) -> None:
        """Called once a chain is drafted (EAGLE drops the entries fed by its own states)."""

    def draft_round(self, work: list, out: list[list[int]], ks: list[int]) -> bool:
        """Draft whole chains at once: ``work`` holds ``[i, seq, ids, hidden]`` per request
        (what :meth:`catch_up` gave); False (nothing done) where this proposer cannot."""
        return False

    def decode_chain(self, live: list, out: list[list[int]], ks: list[int]) -> bool:
        """Draft the rest of the chains at once (``live``, ``out``, ``ks`` as in
        :meth:`decode_steps`); False (nothing done) where this proposer cannot."""
        return False

    def decode_steps(self, live: list, out: list[list[int]], ks: list[int]) -> None:
        """One batched DECODE forward per further draft token, until ``out[i]`` holds
        ``ks[i]`` drafts or the pool is full.

        Args:
            live: ``(i, seq, hidden)`` per request still drafting: its index in ``out``, its
                ``DraftSeq``, and (EAGLE) the ``[1, hidden]`` state after its last draft.
            out: the drafts so far per request (appended to); ks: the chain lengths.
        """
        while True:
            live = [x for x in live if len(out[x[0]]) < ks[x[0]]]
            if not live:
                break
            rows, prefix, locs = [], [], []
            for i, seq, h in live:
                p = seq.kv_len
                slots = self._grow(seq, [out[i][-1]])
                if slots is None:
                    continue
                rows.append((i, seq, h))
                prefix.append(p)
                locs.extend(slots)
            if not rows:
                break
            seqs = [s for _, s, _ in rows]
            hid = [h for _, _, h in rows]
            batch = ScheduleBatch(ForwardMode.DECODE, seqs, prefix, [1] * len(seqs),
                                  [True] * len(seqs), locs)
            toks, h = self.forward(batch, seqs, torch.cat(hid) if hid[0] is not None else None)
            toks = toks.tolist()
            live = []
            for j, (i, seq, _) in enumerate(rows):
                out[i].append(toks[j])
                live.append((i, seq, None if h is None else h[j:j + 1]))

    # ---- proposing ----------------------------------------------------------------------
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        raise TypeError("a model proposer drafts per request: call propose_reqs")

    @torch.inference_mode()
    def propose_reqs(self, reqs: list, ks: list[int]) -> list[list[int]]:
        """Draft up to ``ks[i]`` tokens for ``reqs[i]``. A draft forward that fails (a bug,
        a device error) costs the step its drafts, never the engine: the requests' draft
        state is dropped and they decode this step."""
        try:
            return self._propose(reqs, ks)
        except Exception:
            logger.exception("draft step failed: %d requests verify without drafts and "
                             "restart their draft state", len(reqs))
            for r in reqs:
                self.drop(r.rid)
            return [[] for _ in reqs]

    def _propose(self, reqs: list, ks: list[int]) -> list[list[int]]:
        self.sweep()
        self._active = {r.rid for r, k in zip(reqs, ks) if k > 0}
        out: list[list[int]] = [[] for _ in reqs]
        work = []  # (index, seq, ids to feed, hidden rows to feed)
        for i, (req, k) in enumerate(zip(reqs, ks)):
            if k <= 0:
                continue
            seq = self.seqs.get(req.rid)
            if seq is None:
                seq = self.seqs[req.rid] = DraftSeq(req)
            feed = self.catch_up(seq, req)
            if feed is None or not feed[0]:
                continue
            work.append([i, seq, feed[0], feed[1]])
        if not work:
            return out
        if self.draft_round(work, out, ks):  # the whole round on the device (EAGLE graphs)
            for _, seq, _, _ in work:
                self.after_propose(seq)
            return out
        # catch-up: EXTEND forwards of at most `chunk` tokens; a request's last chunk gives
        # its first draft token
        nxt: dict[int, tuple[int, torch.Tensor | None]] = {}
        todo = work
        while todo:
            budget, keep, rows, seqs, prefix, ext, locs, hid = self.chunk, [], [], [], [], [], [], []
            for w in todo:
                i, seq, ids, hs = w
                if budget <= 0:
                    keep.append(w)
                    continue
                n = min(len(ids), budget)
                p = seq.kv_len
                slots = self._grow(seq, ids[:n])
                if slots is None:
                    continue  # the draft pool is full: no drafts for it this step
                rows.append(w)
                seqs.append(seq)
                prefix.append(p)
                ext.append(n)
                locs.extend(slots)
                if hs is not None:
                    hid.append(hs[:n])
                    w[3] = hs[n:]
                w[2] = ids[n:]
                if w[2]:
                    keep.append(w)
                budget -= n
            if not rows:
                break
            batch = ScheduleBatch(ForwardMode.EXTEND, seqs, prefix, ext, [True] * len(seqs),
                                  locs)
            toks, h = self.forward(batch, seqs, torch.cat(hid) if hid else None)
            toks = toks.tolist()
            for j, w in enumerate(rows):
                if not w[2]:
                    nxt[w[0]] = (toks[j], None if h is None else h[j:j + 1])
            todo = keep
        # one DECODE per further draft token: as one device chain (EAGLE's head graphs),
        # else step by step
        live = [(i, seq, nxt[i][1]) for i, seq, _, _ in work if i in nxt]
        for i, _, _ in live:
            out[i].append(nxt[i][0])
        live = [x for x in live if len(out[x[0]]) < ks[x[0]]]
        if live and not self.decode_chain(live, out, ks):
            self.decode_steps(live, out, ks)
        for _, seq, _, _ in work:
            self.after_propose(seq)
        return out

    def trim(self, req, valid_len: int) -> None:
        """After a verify step: positions ``< valid_len`` of ``req`` hold accepted tokens;
        drop the draft's entries (and pending hidden states) past them."""
        seq = self.seqs.get(req.rid)
        if seq is None:
            return
        if seq.base + seq.kv_len > valid_len:
            if valid_len <= seq.base:
                self.reset(seq, valid_len)
                return
            self.truncate(seq, valid_len - seq.base)
        end = seq.hidden_start + seq.hidden_rows
        if end > valid_len:
            keep = max(0, valid_len - seq.hidden_start)
            rows = torch.cat(seq.hidden)[:keep] if seq.hidden else None
            seq.hidden = [rows] if keep else []
            seq.hidden_rows = keep
