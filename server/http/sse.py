"""Server-sent events and client disconnects: the ``text/event-stream`` response that runs a
clean-up however it ends, and waiting on work that a client's departure cancels."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import suppress
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

#: the last event of an OpenAI stream
DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def dumps(obj: Any) -> str:
    """Compact JSON text of ``obj`` (non-ASCII kept as it is)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    """One ``data:`` event carrying ``obj`` as JSON."""
    return f"data: {dumps(obj)}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, coro: Coroutine) -> Any:
    """Run ``coro`` but cancel it if the client disconnects first.

    Raises:
        ClientGone: the client left (``coro`` was cancelled; its ``finally`` blocks ran).
    """
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


class SSEResponse(StreamingResponse):
    """A StreamingResponse of ``text/event-stream`` that runs ``on_close`` however the
    stream ends (a client's disconnect too)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
