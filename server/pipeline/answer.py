"""``answer``: a ``ChatJob`` run on the engine, its outputs written by an API family's writer.

The loop is the same for every endpoint family; only the writer differs (chat completions'
and completions' ``data:`` chunks ending in ``data: [DONE]``, ``/v1/responses``' typed
events). Without ``stream`` the outputs are collected and the writer builds one JSON body.
With it, the first output is awaited before the response starts, so an engine rejection is
still a plain HTTP error; after that an error becomes the writer's error events. A client
that leaves before the answer starts gets a 499 (its engine requests aborted); one that
leaves a stream aborts the engine requests still running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.errors import APIError, http_error
from server.http.sse import ClientGone, SSEResponse, run_until_disconnect
from server.pipeline.job import ChatJob
from server.tokenizer_manager import ReqOutput, TokenizerManager

logger = logging.getLogger("ferry.server")


class Writer:
    """How an API family writes a job's answer; subclasses fill in what they need.

    ``fmt`` is the request's renderer (``server/openai/formats.py``'s ``BaseFormat``: its
    ``id`` and ``texts`` go to the request log). Non-stream: ``collect`` takes each output,
    then ``body`` builds the JSON (in a worker thread when ``heavy``). Stream: the text of
    ``start``, of ``events`` per output, then ``end``; an error while streaming ends with
    ``error``'s; ``close`` comes last whatever happened.
    """

    #: what the log says when a stream breaks on an unexpected exception
    failure_log = "stream failed"
    #: build the body in a worker thread (a large one: others are served meanwhile)
    heavy = False

    def __init__(self, fmt: Any):
        self.fmt = fmt

    def collect(self, out: ReqOutput) -> None:
        raise NotImplementedError

    def body(self) -> dict:
        raise NotImplementedError

    def start(self) -> Iterable[str]:
        return ()

    def events(self, out: ReqOutput) -> Iterable[str]:
        raise NotImplementedError

    def end(self) -> Iterable[str]:
        return ()

    def error(self, err: APIError) -> Iterable[str]:
        raise NotImplementedError

    def close(self) -> Iterable[str]:
        return ()


def log_request(enabled: bool, fmt: Any, prompt: Any, sp: Any) -> None:
    """Log a request's prompt and sampling settings (``--log-requests``)."""
    if enabled:
        logger.info("request %s prompt=%.2000r params=%s", fmt.id, prompt, sp)


def log_output(enabled: bool, fmt: Any) -> None:
    """Log a request's output texts (``--log-requests``)."""
    if enabled:
        logger.info("request %s outputs=%.4000r", fmt.id, fmt.texts)


def generate(tm: TokenizerManager, job: ChatJob, stream: bool,
             rids: list[str]) -> AsyncIterator[ReqOutput]:
    """The engine's outputs for ``job`` (``TokenizerManager.generate``); ``rids`` receives
    the engine rids as they are registered (what an abort must name)."""
    return tm.generate(job.subs, stream, arrival=job.arrival, registered=rids, lora=job.lora,
                       images=job.images,
                       lora_param=job.lora_fields)  # the 404 of an adapter unloaded meanwhile


async def _collect(request: Request, gen: AsyncIterator[ReqOutput], writer: Writer,
                   log: bool) -> Response:
    async def run() -> None:
        async for o in gen:
            writer.collect(o)

    try:
        await run_until_disconnect(request, run())
    except ClientGone:
        return Response(status_code=499)
    if writer.heavy:  # built and encoded in a worker thread
        resp = await asyncio.to_thread(lambda: JSONResponse(writer.body()))
    else:
        resp = JSONResponse(writer.body())
    log_output(log, writer.fmt)  # the texts, once the body has rendered them
    return resp


async def _events(head: ReqOutput, gen: AsyncIterator[ReqOutput], writer: Writer,
                  log: bool) -> AsyncIterator[str]:
    try:
        for e in writer.start():
            yield e
        item: ReqOutput | None = head
        while item is not None:
            for e in writer.events(item):
                yield e
            item = await anext(gen, None)
        for e in writer.end():
            yield e
    except APIError as err:
        for e in writer.error(err):
            yield e
    except Exception:  # noqa: BLE001 - logged; the client gets the writer's error events
        logger.exception(writer.failure_log)
        for e in writer.error(http_error(500, "internal error while streaming")):
            yield e
    log_output(log, writer.fmt)
    for e in writer.close():
        yield e


async def answer(request: Request, tm: TokenizerManager, job: ChatJob, writer: Writer,
                 stream: bool, *, log: bool = False) -> Response:
    """Run ``job`` and answer the HTTP request: one JSON body, or an SSE stream.

    Args:
        request: the HTTP request (watched for the client's disconnect).
        tm: the engine client.
        job: what ``prepare`` (or a completions request) built.
        writer: the API family's writer of this request.
        stream: answer with SSE events.
        log: log the output texts (``--log-requests``).
    Returns:
        the JSON response, the ``text/event-stream`` response, or a bare 499 when the
        client left before the answer started.
    Raises:
        APIError: 503 (admission) or the engine's error for a rejected request, before the
            answer starts.
    """
    rids: list[str] = []  # the engine rids generate registers (unique; see request_id)
    gen = generate(tm, job, stream, rids)
    if not stream:
        return await _collect(request, gen, writer, log)

    async def first() -> ReqOutput:
        return await anext(gen)

    try:
        head = await run_until_disconnect(request, first())
    except ClientGone:
        return Response(status_code=499)
    return SSEResponse(_events(head, gen, writer, log), on_close=lambda: tm.abort(rids))
