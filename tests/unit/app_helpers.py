"""A ``build_app`` app over a fake engine, for HTTP tests without processes.

``FakeEngine`` stands in for the engine and the detokenizer: it records every message the
``TokenizerManager`` sends and answers through ``tm._dispatch`` (each generation request
finishes with one token, text "ok"; ``hold`` keeps the answers until ``release``).
"""

from __future__ import annotations

import asyncio

from engine import io_struct as io
from engine.args import ServerArgs
from server.app import build_app
from server.chat_template import ChatTokenizer
from server.replicas import Dispatcher, Replica, ReplicaRouter
from server.tokenizer_manager import TokenizerManager

VOCAB = 49152


class FakeEngine:
    """The ``push`` socket of a ``TokenizerManager``, answering like engine + detokenizer."""

    def __init__(self, tm: TokenizerManager):
        self.tm = tm
        self.sent: list = []
        self.hold = False
        self.held: list = []
        self.num_running = 0
        self.mute_info = False
        self.text = "ok"  # what every generation request answers
        # what every pooling request answers (its prompt ids -> its vector or [score])
        self.pooled = lambda ids: [float(len(ids))]

    def send(self, msg) -> None:
        self.sent.append(msg)
        loop = asyncio.get_running_loop()
        if isinstance(msg, io.TokenizedGenerateReq) and msg.pooling:
            loop.call_soon(self.tm._dispatch, io.PooledOut(
                rids=[msg.rid], outputs=[self.pooled(msg.input_ids)],
                prompt_tokens=[len(msg.input_ids)], cached_tokens=[0]))
        elif isinstance(msg, io.TokenizedGenerateReq):
            out = io.BatchStrOut(rids=[msg.rid], texts=[self.text], new_token_ids=[[7]],
                                 finished_reasons=[{"type": "length", "matched": None}],
                                 prompt_tokens=[len(msg.input_ids)], completion_tokens=[1])
            if self.hold:
                self.held.append(out)
            else:
                loop.call_soon(self.tm._dispatch, out)
        elif isinstance(msg, io.FlushCacheReq):
            loop.call_soon(self.tm._dispatch, io.FlushCacheOut(
                rid=msg.rid, success=not self.tm.states, message="flushed"))
        elif isinstance(msg, io.GetServerInfoReq) and not self.mute_info:
            loop.call_soon(self.tm._dispatch, io.ServerInfoOut(
                rid=msg.rid, kv_used_tokens=0, kv_free_tokens=100, kv_total_tokens=100,
                num_running=self.num_running, num_waiting=0))

    def release(self) -> None:
        for out in self.held:
            self.tm._dispatch(out)
        self.held.clear()

    @property
    def rids(self) -> list[str]:
        return [m.rid for m in self.sent if isinstance(m, io.TokenizedGenerateReq)]


def fake_tm(args: ServerArgs) -> TokenizerManager:
    """A ``TokenizerManager`` without sockets or tokenizer, its engine a ``FakeEngine``."""
    tm = TokenizerManager.__new__(TokenizerManager)
    tm.args = args
    tm.states, tm.ready, tm.retired = {}, {}, {}
    tm.chat, tm.dead, tm.shutting_down = ChatTokenizer(args), None, False
    tm.metrics, tm.last_stats, tm._listener = None, None, None
    tm.push = FakeEngine(tm)
    tm.router = ReplicaRouter([Replica(0, tm.push, ready=tm.ready)], Dispatcher(1),
                              dead=lambda: tm.dead)
    tm._dispatch(io.ReadyOut(rid="engine", max_total_tokens=4096, max_context_len=2048,
                             max_running_requests=4, vocab_size=VOCAB, device="cpu",
                             dtype="float32", model="fake"))
    return tm


def make_app(**kw):
    """``(app, fake engine)`` for ``ServerArgs(**kw)``."""
    args = ServerArgs(**kw)
    tm = fake_tm(args)
    return build_app(tm, args), tm.push
