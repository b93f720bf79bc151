"""The model runner's graphs at start-up: capture them, fall back to eager steps when a
capture raises, and compare one replay of each kind with an eager step before serving.

``build_graphs(runner)`` returns the decode ``GraphRunner`` and the ``PiecewiseRunner`` (each
None when it is off, its capture raised, or its replay disagreed with the eager step):

1. capture: each runner's constructor captures its graphs inside
   ``engine.device.capture_or_eager``, which logs a failure's reason and returns None;
2. agree: under tensor parallelism every rank keeps a runner only when every rank has one
   (graph replays pad a batch to its bucket, so one eager rank would all-reduce tensors of
   another shape than its peers);
3. check: a batch of 7 requests of 7 to 1000 tokens (``CHECK_LENS``, 2180 in all, so that
   the decode replay reads a long KV and the split-KV and padding paths run; deterministic
   ids) is prefilled eagerly and through the piecewise graphs, then decoded one step eagerly
   and by a decode-graph replay; ``engine.device.replay_matches_eager`` compares the logits,
   and a kind of graph whose replay disagrees, or raises, is dropped with the measured
   difference or the error in the log (the ranks agree again). The check borrows ``req_to_token`` rows and KV pages from the
   pools and hands them back in their order, so allocation is as without it. A model with
   linear-attention layers also borrows a recurrent-state slot per request
   (``_CheckStates``): the decode replay and the eager decode each advance the slots' states
   in place, so the states the decode step starts from are kept and put back between them.
   ``FERRY_SKIP_GRAPH_CHECK=1`` skips it.

Every rank runs the same steps on the same batch, so the collectives inside the forwards
line up across ranks without rank 0's step channel.
"""

from __future__ import annotations

import logging

import torch

from engine import device as dev
from engine import distributed as tpd
from engine.executor.schedule_batch import ScheduleBatch, padded_verify_batch
from engine.forward_batch import ForwardMode

logger = logging.getLogger(__name__)

#: prompt lengths of the start-up check's requests (capped by the pool, the context and the
#: piecewise graphs' largest step, 2304 tokens by default): 7 requests, 2180 tokens in flight
#: (3 requests of 147 tokens checked little of a long decode's split KV)
CHECK_LENS = (7, 40, 100, 200, 333, 500, 1000)


def build_graphs(runner):
    """Capture, agree and check (module docstring); returns ``(graph_runner,
    piecewise_runner)``, each possibly None."""
    from engine.executor.graph_runner import GraphRunner
    from engine.executor.piecewise_runner import PiecewiseRunner

    d = runner.device_type
    gr = pw = None
    if runner.attn_backend.supports_graphs:
        gr = dev.capture_or_eager(d, "decode graphs", lambda: GraphRunner(runner))
    else:
        logger.info("decode runs eagerly: the %s attention backend has no graph support",
                    type(runner.attn_backend).__name__)
    if getattr(runner.model, "capture_hidden", None) is not None \
            and not runner.args.disable_piecewise_graph:
        logger.info("prefill and mixed steps run eagerly with an EAGLE head (the piecewise "
                    "graphs do not keep the hidden states it reads; decode graphs do)")
    elif not getattr(runner.model, "supports_piecewise", True) \
            and not runner.args.disable_piecewise_graph:
        logger.info("piecewise graphs are off for %s, prefill and mixed steps run eagerly: "
                    "%s", type(runner.model).__name__,
                    getattr(runner.model, "no_piecewise_reason",
                            "it cannot be cut into piecewise graphs yet"))
    elif runner.lora is not None and not runner.args.disable_piecewise_graph:
        logger.info("prefill and mixed steps run eagerly with LoRA adapters (the piecewise "
                    "graphs do not take the adapter segments yet)")
    elif not getattr(runner.model, "supports_piecewise_graphs", True) \
            and not runner.args.disable_piecewise_graph:
        logger.info("prefill and mixed steps run eagerly: %s's layers do not fit the piecewise "
                    "graphs (per-layer head sizes or inputs)", type(runner.model).__name__)
    elif not runner.args.disable_piecewise_graph:
        pw = dev.capture_or_eager(d, "piecewise graphs",
                                  lambda: PiecewiseRunner(runner, runner.piecewise_max_tokens()))
    gr, pw = _agree(gr, "decode graphs"), _agree(pw, "piecewise graphs")
    if (gr is not None or pw is not None) and not dev.graph_check_skipped():
        gr_ok, pw_ok = check_graphs(runner, gr, pw)
        gr = _agree(gr if gr_ok else None, "decode graphs")
        pw = _agree(pw if pw_ok else None, "piecewise graphs")
    return gr, pw


def _agree(obj, what: str):
    """``obj`` when every rank of the tensor-parallel group has its own, else None."""
    if tpd.min_over_ranks(int(obj is not None)) == 0:
        if obj is not None:
            logger.warning("%s: another tensor-parallel rank runs these steps eagerly, so "
                           "this one does too", what)
        return None
    return obj


class _CheckReq:
    """A ``StepRequest`` for the check: a ``req_to_token`` row and its token ids."""

    def __init__(self, row: int, ids: list[int]):
        self.req_pool_idx = row
        self.ids = ids
        self.state_slot: int | None = None  # a recurrent-state slot (linear attention)

    def tokens(self, start: int, count: int) -> list[int]:
        return self.ids[start:start + count]

    def token_at(self, pos: int) -> int:
        return self.ids[pos]


def _eager(runner, batch: ScheduleBatch) -> torch.Tensor:
    input_ids, fb = runner.build_forward_batch(batch)
    runner.attn_backend.init_step(fb)
    return runner.model(input_ids, fb.positions, fb)


def _check_lens(runner, max_bs: int, max_tokens: int, extra: int = 1) -> list[int]:
    """The check's prompt lengths, within the batch, context, pool and step limits, with
    room for ``extra`` more tokens a request (its decode token; a verify step's rows)."""
    n = min(len(CHECK_LENS), max_bs, runner.req_to_token_pool.available())
    sp = getattr(runner, "state_pool", None)
    if sp is not None:
        n = min(n, sp.available())
    if n < 1:
        return []
    kv = runner.kv_pool
    room = kv.free_tokens() // n - kv.page_size - extra
    lens = [min(L, runner.max_context_len - 1 - extra, room) for L in CHECK_LENS[:n]]
    while sum(lens) > max_tokens and max(lens) > 1:
        lens = [max(1, L // 2) for L in lens]
    return lens if min(lens) >= 1 and sum(lens) <= max_tokens else []


class _CheckStates:
    """The check's recurrent-state slots (one per request; nothing without a state pool) and
    the states its decode step starts from (:meth:`keep`, :meth:`restore`)."""

    def __init__(self, pool, reqs: list[_CheckReq]):
        self.pool, self.slots, self.saved = pool, [], []
        for req in reqs if pool is not None else ():
            req.state_slot = pool.alloc()
            if req.state_slot is not None:
                self.slots.append(req.state_slot)
        self.short = pool is not None and len(self.slots) < len(reqs)

    def keep(self) -> None:
        """Copy the slots' conv and recurrent states of every linear layer."""
        if self.slots:
            idx = torch.tensor(self.slots, dtype=torch.int64).to(self.pool.conv_states[0].device)
            self.saved = [(t, idx, t[idx].clone())
                          for t in (*self.pool.conv_states, *self.pool.recurrent_states)]

    def restore(self) -> None:
        """Put the kept states back (the next decode step starts where the last one did)."""
        for t, idx, v in self.saved:
            t[idx] = v

    def free(self) -> None:
        """Hand the slots back in reverse order (the pool's free list as before)."""
        for slot in reversed(self.slots):
            self.pool.free(slot)


@torch.inference_mode()
def check_graphs(runner, gr, pw) -> tuple[bool, bool]:
    """One replay of each captured kind against an eager step (module docstring).

    Returns:
        ``(decode graphs agree, piecewise graphs agree)``; True for a kind not captured, and
        for both when the pools are too small for the check (logged).
    """
    # a hybrid model's verify graphs: the check's requests also take verify_n rows each
    extra = gr.verify_n if getattr(gr, "verify_graphs", None) else 1
    lens = _check_lens(runner, gr.max_bs if gr is not None else len(CHECK_LENS),
                       pw.max_tokens if pw is not None else sum(CHECK_LENS), extra)
    if not lens:
        logger.info("graph replay check skipped: the KV pool is too small for it")
        return True, True
    g = torch.Generator().manual_seed(0)
    rows_pool, kv = runner.req_to_token_pool, runner.kv_pool
    swa = getattr(runner, "swa_pool", None)  # the windowed layers' pool: twins of the pages
    reqs, pages, slots, twins = [], [], [], []
    for L in lens:
        ids = torch.randint(0, runner.vocab_size, (L + extra,), generator=g).tolist()
        reqs.append(_CheckReq(rows_pool.alloc(), ids))
        pages.append([])
        slots.append(kv.grow(pages[-1], 0, L + extra) or [])
        if swa is not None:
            twins.append(swa.alloc_pages(len(pages[-1])) or [])
            for f, w in zip(pages[-1], twins[-1]):
                swa.page_map[f] = w
    states = _CheckStates(getattr(runner, "state_pool", None), reqs)
    try:
        if any(len(ss) != L + extra for ss, L in zip(slots, lens)) or states.short or \
                any(len(t) != len(pg) for t, pg in zip(twins, pages)):
            logger.info("graph replay check skipped: the KV pool is too small for it")
            return True, True
        prefill = ScheduleBatch(mode=ForwardMode.EXTEND, reqs=reqs, prefix_lens=[0] * len(reqs),
                                extend_lens=list(lens), sample=[True] * len(reqs),
                                out_cache_loc=[s for ss, L in zip(slots, lens) for s in ss[:L]])
        decode = ScheduleBatch(mode=ForwardMode.DECODE, reqs=reqs, prefix_lens=list(lens),
                               extend_lens=[1] * len(reqs), sample=[True] * len(reqs),
                               out_cache_loc=[ss[L] for ss, L in zip(slots, lens)])
        pw_ok = gr_ok = True
        d = runner.device_type
        if pw is not None:  # a replay that raises: warned once, that kind runs eagerly
            replayed = dev.replay_or_none(d, "piecewise graphs", lambda: pw.run(prefill))
            eager = _eager(runner, prefill)  # also what the decode step reads from the pool
            pw_ok = replayed is not None and _verdict(runner, "piecewise graphs", replayed,
                                                      eager)
        else:
            _eager(runner, prefill)  # the decode step reads this prefix from the pool
        if gr is not None:
            states.keep()  # each decode step below starts from the prefill's states
            replayed = dev.replay_or_none(d, "decode graphs", lambda: gr.replay(decode).clone())
            states.restore()
            eager = _eager(runner, decode)
            gr_ok = replayed is not None and _verdict(runner, "decode graphs", replayed, eager)
            # every rank takes the sub-checks below or none (they run collectives)
            gr_ok = tpd.min_over_ranks(int(gr_ok)) == 1
            if gr_ok and getattr(gr, "base_graphs", None):  # LoRA: the kernels' kind too
                states.restore()
                replayed = dev.replay_or_none(d, "decode graphs with LoRA",
                                              lambda: gr.replay(decode, with_lora=True).clone())
                gr_ok = replayed is not None and _verdict(runner, "decode graphs with LoRA",
                                                          replayed, eager)
            if gr_ok and getattr(gr, "verify_graphs", None):
                states.restore()
                _check_verify_graphs(runner, gr, reqs, lens, slots)
        dev.synchronize(d)
    finally:  # hand the rows and pages back so that allocation continues as without the check
        states.free()
        for req, pg in zip(reversed(reqs), reversed(pages)):
            kv.free_pages(pg)
            rows_pool.free(req.req_pool_idx)
        for t in reversed(twins):
            swa.free_pages(t)
    return gr_ok, pw_ok


def _check_verify_graphs(runner, gr, reqs: list, lens: list[int], slots: list[list[int]]
                         ) -> None:
    """A hybrid model's verify graphs: the check's requests as a verify step (each its
    ``verify_n`` next tokens, rows reading the previous rows' states), replayed against the
    same step run eagerly: every row's logits, and the scratch slots' recurrent states after
    each row (what the commit copies), within 1e-2 of the largest; a mismatch on any rank
    drops the verify graphs on every rank (verify steps then run eagerly)."""
    n, k = gr.verify_n, min(len(reqs), gr.verify_buckets[-1])
    locs = [ss[L + j] for ss, L in zip(slots[:k], lens[:k]) for j in range(n)]
    batch, _ = padded_verify_batch(reqs[:k], lens[:k], [n] * k, locs, n)  # no padding rows
    sp = runner.state_pool
    span = slice(sp.scratch_base, sp.scratch_base + k * n)
    replayed = dev.replay_or_none(runner.device_type, "verify graphs",
                                  lambda: gr.replay(batch).clone())
    kept = [t[span].clone() for t in sp.recurrent_states]
    eager = _eager(runner, batch)  # the slots are read, not written: no restore
    ok = replayed is not None and _verdict(runner, "verify graphs", replayed, eager)
    if ok:
        worst = max(((a - t[span]).abs().max() / (t[span].abs().max() + 1e-6)).item()
                    for a, t in zip(kept, sp.recurrent_states))
        ok = worst <= 1e-2
        if not ok:
            logger.warning("verify graphs: the states a replay left in the scratch slots "
                           "differ from an eager step's (%.2e of the largest); verify steps "
                           "run eagerly", worst)
    if tpd.min_over_ranks(int(ok)) == 0:
        gr.verify_graphs.clear()


def _verdict(runner, what: str, replayed: torch.Tensor, eager: torch.Tensor) -> bool:
    ok, detail = dev.replay_matches_eager(replayed, eager, runner.dtype)
    if ok:
        logger.info("%s: a replay matches an eager step (%s)", what, detail)
    else:
        logger.warning("%s: a replay's logits differ from an eager step's on %s (%s); these "
                       "steps run eagerly", what, runner.device_type, detail)
    return ok
