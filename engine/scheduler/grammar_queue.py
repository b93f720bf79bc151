"""``GrammarQueue``: constrained requests wait here until their grammar is compiled.

``Scheduler.add_request`` hands a request with a constraint (``SamplingParams.json_schema``,
``regex`` or ``ebnf``) to the queue, which starts its compile on ``GrammarBackend``'s thread
pool (cached by ``(kind, text)``). Each step ``release`` moves the requests whose grammar is
ready into the waiting queue, with a fresh matcher (``Req.grammar``), and aborts those whose
compile failed (the server has parsed the constraint already, so that is rare). SGLang's
``grammar_queue`` works the same way.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait

from engine.sampling.grammar import GrammarBackend, GrammarState, grammar_key
from engine.scheduler.request import FinishReason, Req

logger = logging.getLogger(__name__)

#: seconds ``release`` blocks on a pending compile when the scheduler has nothing else to run
IDLE_WAIT_S = 0.01


class GrammarQueue:
    """Requests waiting for a compiled grammar.

    Args:
        tokenizer: the model's transformers tokenizer, or None (then every constrained
            request is aborted: a grammar needs the vocabulary's strings).
        vocab_size: V, the width of the logits.
        eos_ids: the model's stop tokens.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.backend: GrammarBackend | None = None
        self.pending: list[tuple[Req, Future | str]] = []

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, req: Req) -> bool:
        """Queue ``req`` if it has a constraint; False (nothing done) when it has none."""
        key = grammar_key(req.sampling_params)
        if key is None:
            return False
        if self.tokenizer is None:
            self.pending.append((req, "constrained decoding needs a tokenizer"))
            return True
        if self.backend is None:
            self.backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_ids)
        self.pending.append((req, self.backend.submit(*key)))
        return True

    def release(self, sched) -> None:
        """Move ready requests to ``sched.waiting``; abort failed ones (``_abort_now``).

        Waits up to ``IDLE_WAIT_S`` for a compile when ``sched`` has nothing else to run, so
        the engine loop does not spin.
        """
        if not self.pending:
            return
        if not (sched.running or sched.waiting or sched.chunked or sched.inflight):
            futs = [f for _, f in self.pending if isinstance(f, Future)]
            if futs and not any(f.done() for f in futs):
                wait(futs, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        keep = []
        for req, fut in self.pending:
            if req.finished:
                continue  # aborted while its grammar compiled
            if isinstance(fut, Future) and not fut.done():
                keep.append((req, fut))
                continue
            error = fut if isinstance(fut, str) else None
            if error is None:
                try:
                    req.grammar = GrammarState(fut.result())
                except Exception as exc:  # noqa: BLE001 - a compile error
                    error = str(exc.args[0]) if exc.args else repr(exc)
            if error is None:
                sched.waiting.append(req)
            else:
                logger.info("request %s: %s", req.rid, error)
                sched._abort_now(req, error)
        self.pending = keep


def grammar_finish(req: Req, tok: int) -> FinishReason | None:
    """Accept ``tok`` into ``req``'s matcher: ``stop`` when the grammar is complete, ``abort``
    when it rejects the token (only possible when every token was masked), else None."""
    g = req.grammar
    if not g.accept(tok):
        return FinishReason("abort", message=f"token {tok} does not fit the grammar")
    if g.terminated:
        return FinishReason("stop", matched=tok)
    return None
