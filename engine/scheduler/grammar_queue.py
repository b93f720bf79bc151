"""``GrammarQueue``: constrained requests wait here until their grammar is compiled.

``Scheduler.add_request`` hands a request with a constraint (``SamplingParams.json_schema``,
``regex`` or ``ebnf``) to the queue, which starts its compile on ``GrammarBackend``'s thread
pool (cached by ``(kind, text)``). Each step ``release`` hands the scheduler the requests
whose grammar is ready (with a fresh matcher, ``Req.grammar``, which waits for the request's
``think_end_id`` or the sequence ``think_end_ids`` when it has one: constrained after the
reasoning), which it puts in its waiting queue, and those it aborts: their compile failed (the server has parsed the constraint
already, so that is rare) or has not finished within the compile budget
(``--grammar-compile-timeout``: compile cost grows superlinearly with some schema shapes,
e.g. hundreds of optional properties in one object). Those requests are also listed in ``rejected`` for the engine loop, which answers them with a
400 (``ErrorOut``) instead of a finished output. A compile past its budget keeps its pool
thread until it ends (xgrammar cannot be interrupted); its result stays cached. SGLang's
``grammar_queue`` works the same way.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

from engine.sampling.grammar import GrammarBackend, GrammarState, grammar_key
from engine.scheduler.request import FinishReason, Req

logger = logging.getLogger(__name__)

#: seconds ``release`` blocks on a pending compile when the scheduler has nothing else to run
IDLE_WAIT_S = 0.01
#: default seconds a constraint may take to compile (ServerArgs.grammar_compile_timeout)
COMPILE_BUDGET_S = 10.0


class GrammarQueue:
    """Requests waiting for a compiled grammar.

    Args:
        tokenizer: the model's transformers tokenizer, or None (then every constrained
            request is aborted: a grammar needs the vocabulary's strings).
        vocab_size: V, the width of the logits.
        eos_ids: the model's stop tokens.
        budget_s: seconds a compile may take, from the request's arrival in the queue.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int],
                 budget_s: float = COMPILE_BUDGET_S):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.budget_s = budget_s
        self.backend: GrammarBackend | None = None
        # (request, its compile or an error, time.monotonic() it was queued)
        self.pending: list[tuple[Req, Future | str, float]] = []
        # rid -> (message, param, code) of the requests the last ``release`` aborted for
        # their constraint: the client's fault, answered with a 400 by the engine loop
        self.rejected: dict[str, tuple[str, str, str]] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, req: Req) -> bool:
        """Queue ``req`` if it has a constraint; False (nothing done) when it has none."""
        key = grammar_key(req.sampling_params)
        if key is None:
            return False
        now = time.monotonic()
        if self.tokenizer is None:
            self.pending.append((req, "constrained decoding needs a tokenizer", now))
            return True
        if self.backend is None:
            self.backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_ids)
        self.pending.append((req, self.backend.submit(*key), now))
        return True

    def take_rejected(self) -> dict[str, tuple[str, str, str]]:
        """The requests the last ``release`` rejected (and forget them)."""
        out, self.rejected = self.rejected, {}
        return out

    def release(self, idle: bool) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Take the requests whose compile has ended (or run past its budget) out of the
        queue.

        Args:
            idle: whether the scheduler has nothing else to run; then this waits up to
                ``IDLE_WAIT_S`` for a compile, so the engine loop does not spin.

        Returns:
            ``(ready, rejected)``: the requests whose matcher (``Req.grammar``) is set, for
            the waiting queue, and ``(request, message)`` for those to abort. ``rejected``
            (the attribute) holds this call's rejections only, for ``take_rejected``.
        """
        self.rejected = {}
        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        if not self.pending:
            return ready, failed
        if idle:
            futs = [f for _, f, _ in self.pending if isinstance(f, Future)]
            if futs and not any(f.done() for f in futs):
                wait(futs, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        keep = []
        now = time.monotonic()
        for req, fut, t0 in self.pending:
            if req.finished:
                continue  # aborted while its grammar compiled
            kind = (grammar_key(req.sampling_params) or ("constraint", ""))[0]
            error, code = (fut, "constraint_not_supported") if isinstance(fut, str) \
                else (None, "invalid_constraint")
            if error is None and not fut.done():
                if now - t0 <= self.budget_s:
                    keep.append((req, fut, t0))
                    continue
                error = (f"the {kind} constraint did not compile within {self.budget_s:g} s "
                         "(the grammar compile budget, --grammar-compile-timeout); simplify "
                         "it (fewer optional properties, enum values or anyOf branches)")
                code = "constraint_too_complex"
            elif error is None:
                try:
                    req.grammar = GrammarState(fut.result())
                    sp = req.sampling_params
                    if sp.think_end_id is not None:  # after the reasoning
                        req.grammar.wait_for = sp.think_end_id
                    elif sp.think_end_ids:  # after a header (gpt-oss's final channel)
                        req.grammar.wait_after(sp.think_end_ids, req.origin_input_ids)
                except Exception as exc:  # noqa: BLE001 - a compile error
                    error = str(exc.args[0]) if exc.args else repr(exc)
            if error is None:
                ready.append(req)
            else:
                logger.info("request %s: %s", req.rid, error)
                self.rejected[req.rid] = (error, kind, code)
                failed.append((req, error))
        self.pending = keep
        return ready, failed


def grammar_finish(req: Req, tok: int) -> FinishReason | None:
    """Accept ``tok`` into ``req``'s matcher: ``stop`` when the grammar is complete, ``abort``
    when it rejects the token (only possible when every token was masked), else None."""
    g = req.grammar
    if not g.accept(tok):
        return FinishReason("abort", message=f"token {tok} does not fit the grammar")
    if g.terminated:
        return FinishReason("stop", matched=tok)
    return None
