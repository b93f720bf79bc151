"""``TokenizerManager``: the server side of a request's life.

It tokenizes (in a thread, so the event loop stays responsive), checks the prompt against the
engine's limits, sends ``TokenizedGenerateReq`` to the engine and hands every output back to
the waiting route. One state per rid holds an ``asyncio.Queue``; a single listener task
receives everything the detokenizer and the engine push to the server's PULL socket and
dispatches it. Requests that fan out (``n`` > 1, several prompts) share one queue.
With ``--dp-size N`` there is one PUSH and one PULL socket (and listener) per engine replica
(``server/replicas.py``): each engine request goes to the replica its ``Dispatcher`` picks,
and its outputs and abort stay with that replica.

It is composed of two members: ``chat`` (``server/chat_template.py``'s ``ChatTokenizer``:
the tokenizer, the chat template and its tools fallback) and ``router``
(``server/replicas.py``'s ``ReplicaRouter``: which replica each rid runs on, and the control
requests to the engines, ``server_info``, ``flush_cache``, ``change_lora``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from engine import io_struct as io
from engine.ipc import SERVER_IN, AsyncPullSocket, IpcPaths, PushSocket
from engine.sampling.params import SamplingParams
from engine.validation import RequestError, validate_request
from server.chat_template import ChatTokenizer
from server.http.errors import APIError, bad_request, unavailable
from server.media.fetch import MediaLimits
from server.media.process import ImageProcessor
from server.metrics import Metrics, format_request_log
from server.replicas import Dispatcher, Replica, ReplicaRouter

logger = logging.getLogger("ferry.server")

#: an aborted rid whose end never comes back from the engine is reusable after this long
RETIRED_RID_TTL_S = 60.0


@dataclass
class ReqOutput:
    """One output of one engine request, as the route sees it.

    ``index`` is the request's position in the ``generate`` call; ``text`` the new text;
    ``token_ids`` the new token ids (an EOS or stop token id included, though not in the
    text); ``finish_reason`` None or ``{"type": "stop"|"length"|"abort", "matched",
    "message"}``; token counts are totals so far. ``logprobs``: per new token
    ``(logprob, [[id, logprob], ...top k])`` when asked for; ``prompt_logprobs``: one entry
    per prompt token (None for the first), on the request's first output only.
    ``cached_tokens``: prompt tokens the engine found in its prefix cache (-1: not looked up).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    cached_tokens: int = -1
    pooled: list[float] | None = None  # a pooling request's answer (PooledOut)


@dataclass
class _ReqState:
    queue: asyncio.Queue
    index: int
    t_arrival: float
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = -1
    queue_s: float | None = None  # the engine's Req.queue_time, once it reports one
    t_first: float | None = None
    t_last: float = 0.0
    itl: list[float] = field(default_factory=list)
    lora_param: str | None = None  # the field that named its adapter (lora_path)


class TokenizerManager:
    """Tokenize, send to the engine, and route outputs back per rid.

    Args:
        server_args: the ``ServerArgs``.
        ipc: the ``IpcPaths``; binds the PULL socket at ``ipc.server`` (so bind before the
            children start) and connects a PUSH socket to ``ipc.engine``.
        replica_ipcs: the other replicas' ``IpcPaths`` (``--dp-size``).
    Members:
        chat: the ``ChatTokenizer`` (tokenize, decode, chat template).
        router: the ``ReplicaRouter`` (replica of each rid, control requests).
    """

    #: the model's image processing (``server/media/process.py``; None: text only; set at
    #: start-up) and where images may come from (``server/media/fetch.py``)
    images: ImageProcessor | None = None
    media_limits: MediaLimits = MediaLimits()

    def __init__(self, server_args, ipc: IpcPaths, replica_ipcs: list[IpcPaths] = ()):
        self.args = server_args
        self.ctx = zmq.Context()
        self.actx = zmq.asyncio.Context()
        self.pull = AsyncPullSocket(self.actx, ipc.server, SERVER_IN, bind=True)
        self.push = PushSocket(self.ctx, ipc.engine)
        # replica 0 is ``ipc``; ``replica_ipcs`` the others (--dp-size)
        replicas = [Replica(0, self.push, self.pull)] + [
            Replica(i, PushSocket(self.ctx, p.engine),
                    AsyncPullSocket(self.actx, p.server, SERVER_IN, bind=True))
            for i, p in enumerate(replica_ipcs, 1)]
        self.router = ReplicaRouter(replicas, Dispatcher(
            len(replicas), server_args.load_balance_method,
            server_args.dp_balance_abs_threshold, server_args.dp_balance_rel_threshold),
            dead=lambda: self.dead)
        self.chat = ChatTokenizer(server_args)
        self.media_limits = MediaLimits.from_args(server_args)
        self.states: dict[str, _ReqState] = {}
        # rid -> time.monotonic() of its abort: reserved until the engine sends its end
        self.retired: dict[str, float] = {}
        self.ready: dict[str, io.ReadyOut] = replicas[0].ready
        # LoRA: whether the engines serve adapters, and the loaded ones (name -> path), from
        # the engine's ReadyOut, then from each load/unload answer
        self.lora_enabled = False
        self.lora_adapters: dict[str, str] = {}
        self.dead: str | None = None          # why the engine side is gone
        self.shutting_down = False
        self.metrics: Metrics | None = None
        self.last_stats: io.StatsOut | None = None
        self._listener: asyncio.Task | None = None
        self._listeners: list[asyncio.Task] = []

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the listener task (call inside the running event loop)."""
        loop = asyncio.get_running_loop()
        self._listeners = [loop.create_task(self._listen(r)) for r in self.replicas]
        self._listener = self._listeners[0]

    async def aclose(self) -> None:
        """Stop the listeners and close the sockets."""
        for task in self._listeners:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for r in self.replicas:
            r.pull.close()
            r.push.close()
        self.actx.term()
        self.ctx.term()

    def set_tokenizer(self, tokenizer) -> None:
        """Use ``tokenizer`` (None: token-id prompts only): ``ChatTokenizer.set_tokenizer``,
        with the engine's model architecture once it is ready."""
        ready = self.engine_ready
        self.chat.set_tokenizer(tokenizer, ready.architecture if ready is not None else "")

    @property
    def replicas(self) -> list[Replica]:
        """The engine replicas (``router.replicas``; one without ``--dp-size``)."""
        return self.router.replicas

    @property
    def engine_ready(self) -> io.ReadyOut | None:
        return self.ready.get("engine")

    @property
    def max_context_len(self) -> int:
        return self.engine_ready.max_context_len

    @property
    def vocab_size(self) -> int:
        return self.engine_ready.vocab_size

    @property
    def num_inflight(self) -> int:
        """Engine requests the server waits on."""
        return len(self.states)

    def admission_limit(self) -> int:
        """Most engine requests in flight: running plus ``--max-queued-requests`` waiting."""
        running = self.engine_ready.max_running_requests if self.engine_ready else 0
        live = sum(r.alive for r in self.replicas) or 1
        return (running or self.args.max_running_requests) * live + \
            self.args.max_queued_requests

    # ---- listener -----------------------------------------------------------------------
    async def _listen(self, replica: Replica) -> None:
        while True:
            try:
                msg = await replica.pull.recv()
            except asyncio.CancelledError:
                raise
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("dropped an undecodable message: %s", exc)
                continue
            try:
                self._dispatch(msg, replica.index)
            except Exception:
                logger.exception("failed to dispatch %s", type(msg).__name__)

    def _dispatch(self, msg, replica: int = 0) -> None:
        if isinstance(msg, io.BatchStrOut):
            self._on_outputs(msg)
        elif isinstance(msg, io.PooledOut):
            self._on_pooled(msg)
        elif isinstance(msg, io.ErrorOut):
            st = self.states.pop(msg.rid, None)
            if st is not None:
                self.router.release(msg.rid)
                param = (st.lora_param if msg.code == "model_not_found" and st.lora_param
                         else msg.param)  # an adapter unloaded since the route's check
                st.queue.put_nowait(APIError(msg.message, msg.status, param, msg.code))
                self._record_finish(msg.rid, st, "abort")
        elif isinstance(msg, (io.FlushCacheOut, io.LoRAOut)):
            self.router.resolve(msg)
        elif isinstance(msg, io.ServerInfoOut):
            self.router.resolve(msg)
            self.replicas[replica].figures = msg
            self._on_engine_stats(msg, replica)
        elif isinstance(msg, io.StatsOut):
            self.last_stats = msg
            self._on_engine_stats(msg, replica)
        elif isinstance(msg, io.ReadyOut):
            self.replicas[replica].ready[msg.rid] = msg
            if msg.rid == "engine" and replica == 0:
                self.lora_enabled, self.lora_adapters = msg.lora_enabled, dict(msg.lora_adapters)
            if msg.rid == "engine" and self.metrics is None:
                self.metrics = Metrics(self.args.served_model_name or msg.model,
                                       max_context_len=max(1, msg.max_context_len))

    def _on_outputs(self, b: io.BatchStrOut) -> None:
        now = time.monotonic()
        for i, rid in enumerate(b.rids):
            st = self.states.get(rid)
            if st is None:  # aborted or failed already
                if b.finished_reasons[i] is not None:
                    self.retired.pop(rid, None)  # the engine is done with it: reusable
                continue
            ids = b.new_token_ids[i]
            k = len(ids)
            if k:
                if st.t_first is None:
                    st.t_first = now
                else:
                    st.itl.extend([(now - st.t_last) / k] * k)
                st.t_last = now
            fin = b.finished_reasons[i]
            st.prompt_tokens = b.prompt_tokens[i]
            st.completion_tokens = b.completion_tokens[i]
            lp = b.logprobs[i] if i < len(b.logprobs) else None
            plp = b.prompt_logprobs[i] if i < len(b.prompt_logprobs) else None
            if i < len(b.cached_tokens):
                st.cached_tokens = b.cached_tokens[i]
            if i < len(b.queue_time_s) and b.queue_time_s[i] >= 0:
                st.queue_s = b.queue_time_s[i]
            st.queue.put_nowait(ReqOutput(st.index, b.texts[i], ids, fin, b.prompt_tokens[i],
                                          b.completion_tokens[i], lp, plp, st.cached_tokens))
            if fin is not None:
                del self.states[rid]
                self.router.release(rid)
                self._record_finish(rid, st, str(fin.get("type", "stop")))

    def _on_pooled(self, b: io.PooledOut) -> None:
        """Pooling answers: each ends its request (finish ``stop``, no tokens)."""
        now = time.monotonic()
        for i, rid in enumerate(b.rids):
            st = self.states.pop(rid, None)
            if st is None:  # aborted or failed already
                self.retired.pop(rid, None)
                continue
            st.t_first = st.t_last = now
            st.prompt_tokens = b.prompt_tokens[i]
            if i < len(b.cached_tokens):
                st.cached_tokens = b.cached_tokens[i]
            fin = {"type": "stop", "matched": None, "message": None}
            st.queue.put_nowait(ReqOutput(st.index, "", [], fin, st.prompt_tokens, 0,
                                          cached_tokens=st.cached_tokens,
                                          pooled=b.outputs[i]))
            self.router.release(rid)
            self._record_finish(rid, st, "stop")

    def _on_engine_stats(self, msg, replica: int) -> None:
        msg = self.router.gauge_stats(msg, replica)
        if self.metrics is not None:
            self.metrics.on_engine_stats(msg)

    def _record_finish(self, rid: str, st: _ReqState, reason: str) -> None:
        now = time.monotonic()
        e2e = now - st.t_arrival
        ttft = None if st.t_first is None else st.t_first - st.t_arrival
        if self.metrics is not None:
            try:
                self.metrics.on_request_finished(
                    finish_reason=reason, prompt_tokens=st.prompt_tokens,
                    completion_tokens=st.completion_tokens, ttft_s=ttft, e2e_s=e2e,
                    queue_s=st.queue_s, itl_s=st.itl,
                    cached_tokens=st.cached_tokens if st.cached_tokens >= 0 else None)
            except ValueError:
                logger.exception("bad metrics sample for %s", rid)
        level = logging.INFO if self.args.log_requests else logging.DEBUG
        if logger.isEnabledFor(level):
            logger.log(level, format_request_log(rid, st.prompt_tokens, st.completion_tokens,
                                                 ttft, e2e, reason))

    # ---- tokenization and checks --------------------------------------------------------
    def image_pad(self) -> tuple[int, str] | None:
        """The image model's image-pad token ``(id, text)`` (``<|image_pad|>``), or None
        for a text-only model."""
        if self.images is None:
            return None
        pad = self.images.image_token_id
        tok = self.chat.tokenizer
        text = tok.convert_ids_to_tokens(pad) if tok is not None else None
        return pad, text if isinstance(text, str) else f"token {pad}"

    def check_image_tokens(self, input_ids: list[int], image_tokens: int, param: str) -> None:
        """400 naming ``param`` when the prompt holds image-pad tokens that no image stands
        behind (typed as text, or sent as token ids): the model would read them as image
        positions. ``image_tokens``: the positions the prompt's images fill (0: none)."""
        pad = self.image_pad()
        if pad is None or input_ids.count(pad[0]) == image_tokens:
            return
        raise bad_request(f"{pad[1]!r} (token id {pad[0]}) is this model's image placeholder: "
                          "only an image part may put it in a prompt; remove it from the "
                          "text or token ids", param)

    def check_prompt(self, input_ids: list[int], max_tokens: int | None, param: str, *,
                     max_tokens_param: str | None = None, min_tokens: int = 0,
                     image_tokens: int = 0) -> None:
        """Validate a tokenized prompt against the engine's limits
        (``engine.validation.validate_request``, the checks the engine and ``LLM`` run).

        The route has verified the rest of the ``SamplingParams`` already; only
        ``max_tokens`` and ``min_tokens`` matter here.

        Args:
            input_ids: the prompt's token ids.
            max_tokens: the completion's token budget; None: up to the context.
            param: the prompt's field (``prompt``, ``messages``).
            max_tokens_param: the field the client set ``max_tokens`` with
                (``max_tokens``, ``max_completion_tokens``), or None if it is a default.
            min_tokens: tokens the completion must have before EOS may end it.
            image_tokens: the prompt positions its images fill (``check_image_tokens``).
        Raises:
            APIError: 400 for a bad max_tokens/min_tokens, an empty prompt, a token id
                outside ``[0, vocab_size)`` or a request beyond the context (code
                ``context_length_exceeded``), naming ``param`` when the prompt leaves no
                room for one token,
                ``max_tokens_param`` when the prompt fits but not with the asked max_tokens,
                and ``min_tokens`` when prompt + min_tokens does not fit; naming ``param``
                for image-pad tokens without an image (an image model).
        """
        self.check_image_tokens(input_ids, image_tokens, param)
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens)
        try:
            validate_request(input_ids, sp, self.vocab_size, self.max_context_len, param,
                             max_tokens_param=max_tokens_param)
        except RequestError as exc:
            raise bad_request(exc.message, exc.param, exc.code) from None

    def check_admission(self, count: int) -> None:
        """Raise 503 when the engine is gone, the server is stopping, or the queue is full."""
        if self.dead is not None:
            raise unavailable(f"the engine is not running ({self.dead})")
        if self.shutting_down:
            raise unavailable("the server is shutting down")
        if self.num_inflight + count > self.admission_limit():
            raise unavailable("the request queue is full; retry later")

    # ---- generation ---------------------------------------------------------------------
    def unique_rids(self, rids: list[str]) -> list[str]:
        """``rids``, or, when one is in use (a client reusing its ``X-Request-Id`` while the
        first request is in flight, or aborted but not yet ended in the engine, which keeps
        it until its next step), each with the same new suffix ``-{8 hex digits}``."""
        now = time.monotonic()
        self.retired = {r: t for r, t in self.retired.items() if now - t < RETIRED_RID_TTL_S}
        while any(r in self.states or r in self.retired for r in rids):
            tag = uuid.uuid4().hex[:8]
            rids = [f"{r}-{tag}" for r in rids]
        return rids

    async def generate(self, reqs: list[tuple[str, list[int], SamplingParams]], stream: bool,
                       arrival: float | None = None,
                       registered: list[str] | None = None,
                       lora: str | list[str | None] | None = None,
                       lora_param: list[str | None] | None = None,
                       pooling: bool = False, images: list | None = None
                       ) -> AsyncIterator[ReqOutput]:
        """Send engine requests and yield their outputs as they come.

        Args:
            reqs: ``(rid, input_ids, sampling_params)`` per engine request; an output's
                ``index`` is the position in this list.
            stream: whether the client streams (passed to the engine).
            arrival: ``time.monotonic()`` when the HTTP request arrived (for TTFT/E2E).
            registered: a list this appends the engine rids to as it registers them: the
                given ones, or ``unique_rids``' when one of them is in flight already.
            lora: the LoRA adapter every request runs on (None: the base model), or a list
                of one adapter (or None) per entry of ``reqs``.
            lora_param: per entry of ``reqs``, the body field that named its adapter
                (``lora_choice.lora_fields``; None: ``model``): the engine's 404 for an
                adapter unloaded meanwhile names it.
            pooling: pooling requests (embeddings, scores; ``server/pooling/``): each
                output carries its answer in ``pooled``.
            images: the prompt's images (``engine.io_struct.ImageData``), sent with every
                entry of ``reqs`` (a chat job's requests share its one prompt).
        Yields:
            ``ReqOutput`` until every request has finished.
        Raises:
            APIError: 503 (admission), or the engine's error for a rejected request.
        If the consumer stops early (client gone, cancellation), unfinished requests are
        aborted in the engine.
        """
        self.check_admission(len(reqs))
        loras = lora if isinstance(lora, list) else [lora] * len(reqs)
        if len(loras) != len(reqs):
            raise ValueError(f"{len(loras)} adapters for {len(reqs)} requests")
        queue: asyncio.Queue = asyncio.Queue()
        t0 = arrival if arrival is not None else time.monotonic()
        now = time.time() - (time.monotonic() - t0)  # the arrival, on the wall clock
        rids: list[str] = registered if registered is not None else []  # ours to abort
        try:
            unique = self.unique_rids([r[0] for r in reqs])  # no await until registered
            for idx, (rid, (_, ids, _)) in enumerate(zip(unique, reqs)):
                self.states[rid] = _ReqState(queue, idx, t0, len(ids),
                                             lora_param=lora_param[idx] if lora_param else None)
                rids.append(rid)
            for rid, (_, ids, sp), name in zip(unique, reqs, loras):
                self.router.push_for(rid, ids).send(io.TokenizedGenerateReq(rid=rid, input_ids=ids,
                                                       sampling_params=sp, stream=stream,
                                                       arrival_time=now, lora_name=name,
                                                       pooling=pooling,
                                                       images=images or []))
            remaining = len(reqs)
            while remaining:
                item = await queue.get()
                if isinstance(item, APIError):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            self.abort(rids)

    def abort(self, rids: list[str], message: str = "aborted") -> None:
        """Abort the still-running ones of ``rids`` (synchronous: safe in ``finally``)."""
        for rid in rids:
            st = self.states.pop(rid, None)
            if st is None:
                continue
            self.retired[rid] = time.monotonic()  # until the engine's end for it arrives
            sock = self.router.abort_socket(rid)
            if self.dead is None and sock is not None:
                try:
                    sock.send(io.AbortReq(rid=rid))
                except zmq.ZMQError:
                    logger.exception("could not send the abort of %s", rid)
            self._record_finish(rid, st, "abort")

    def abort_all(self, message: str) -> None:
        """End every request with ``finish_reason`` "abort" (shutdown)."""
        for rid, st in list(self.states.items()):
            st.queue.put_nowait(ReqOutput(st.index, "", [], {"type": "abort", "matched": None,
                                                             "message": message},
                                          st.prompt_tokens, st.completion_tokens))
            self.abort([rid], message)

    def fail_all(self, err: APIError) -> None:
        """Fail every waiting request with ``err`` (a child process died)."""
        for rid, st in list(self.states.items()):
            st.queue.put_nowait(err)
            del self.states[rid]
            self.router.release(rid)
            self._record_finish(rid, st, "abort")
        self.router.fail_waiters(err)

    def on_child_died(self, name: str, exitcode: int | None) -> None:
        """Mark the engine side dead and fail every waiting request with a 503."""
        self.dead = f"the {name} process exited with code {exitcode}"
        self.fail_all(unavailable(f"the engine is not running ({self.dead})"))

    def on_replica_died(self, index: int, name: str, exitcode: int | None) -> None:
        """Take replica ``index`` out of dispatch and fail its waiting requests with a 503;
        the last one to die is ``on_child_died``."""
        owned = self.router.take_down(index, name, exitcode)
        if owned is None:
            self.on_child_died(name, exitcode)
            return
        err = unavailable(f"engine replica {index} died ({self.replicas[index].dead}); retry "
                          "the request")
        for rid in owned:
            st = self.states.pop(rid, None)
            self.router.release(rid)
            if st is not None:
                st.queue.put_nowait(err)
                self._record_finish(rid, st, "abort")

    async def change_lora(self, name: str, path: str | None = None) -> io.LoRAOut:
        """Load adapter ``name`` from ``path`` (unload it when ``path`` is None) in every
        live engine (``ReplicaRouter.change_lora``); ``lora_adapters`` follows.

        Raises: APIError 503 if an engine is dead or does not answer in time."""
        out, self.lora_adapters = await self.router.change_lora(name, path, self.lora_adapters)
        return out
