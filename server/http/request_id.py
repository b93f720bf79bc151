"""Request ids: the ``X-Request-Id`` header in, the request's id out on every response.

A client may name its request with ``X-Request-Id`` (1 to ``MAX_REQUEST_ID_LEN`` printable
ASCII characters, no spaces); the generation routes then use it as the response's ``id``
(not ``/v1/responses``: a stored response's id is always server-made and random,
``server/responses/store.py``), the engine's request id and the id in the request log, as
vLLM does with the header (vLLM
prefixes it with ``chatcmpl-``/``cmpl-`` in the body; ferry keeps it as sent, so the body,
the log and the response header show the same string). Choice ``i`` of an ``n > 1`` request
is ``{id}-{i}`` in the engine. A client that reuses an id still in flight is served: the
engine request gets a unique suffix (``TokenizerManager.generate``), the client still sees
its own id.

Without the header the route makes an id (``cmpl-…``, ``chatcmpl-…``; ``req-…`` for the
other routes) and the response carries it as ``X-Request-Id``, so every response (streams,
errors, 404s and 401s included) has one. A malformed header is a 400 (OpenAI-shaped).
"""

from __future__ import annotations

import re
import uuid

from server.http.errors import APIError

HEADER = "X-Request-Id"
MAX_REQUEST_ID_LEN = 256
_HEADER_BYTES = HEADER.lower().encode()
_VALID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID_LEN)
#: key of the id in the ASGI scope's ``state`` (``request.state.request_id``)
STATE_KEY = "request_id"
_FROM_CLIENT = "request_id_from_client"


def new_id(prefix: str = "req") -> str:
    """A fresh id: ``{prefix}-{32 hex digits}``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def parse_header(values: list[bytes]) -> str | None:
    """The client's request id from the raw ``X-Request-Id`` header values, or None.

    Raises:
        APIError: 400 (code ``invalid_request_id``) for a repeated header, an empty one, one
            longer than MAX_REQUEST_ID_LEN or with a character outside printable ASCII
            (``!`` to ``~``: no spaces, no control characters).
    """
    if not values:
        return None
    if len(values) > 1:
        raise APIError(f"send at most one {HEADER} header", 400, None, "invalid_request_id")
    if not _VALID.fullmatch(values[0]):
        raise APIError(f"the {HEADER} header must be 1 to {MAX_REQUEST_ID_LEN} printable "
                       "ASCII characters without spaces", 400, None, "invalid_request_id")
    return values[0].decode("ascii")


def request_id_of(request, prefix: str, fresh: str | None = None) -> str:
    """The id of ``request``: the client's ``X-Request-Id``, else ``fresh`` when given (the
    Responses API passes the response's server-made id), else a new ``{prefix}-…`` id; the
    id made here becomes the one the response header carries."""
    state = request.scope.setdefault("state", {})
    if state.get(_FROM_CLIENT):
        return state[STATE_KEY]
    rid = state[STATE_KEY] = fresh or new_id(prefix)
    return rid


def adopt(request, rid: str, param: str) -> str:
    """Make ``rid`` (a request id the body named: SGLang's ``rid``, vLLM's ``request_id``)
    the id of ``request``, as ``X-Request-Id`` would; returns it.

    Raises:
        APIError: 400 naming ``param`` when an ``X-Request-Id`` header names another id.
    """
    state = request.scope.setdefault("state", {})
    if state.get(_FROM_CLIENT) and state.get(STATE_KEY) != rid:
        raise APIError(f"{param} and the {HEADER} header name different ids", 400, param,
                       "invalid_request_id")
    state[STATE_KEY] = rid
    return rid


class RequestIdMiddleware:
    """Pure ASGI middleware: reads ``X-Request-Id`` into ``scope["state"]["request_id"]``
    (a new ``req-…`` id without one; a route may replace it with its own, see
    ``request_id_of``) and adds the id as ``X-Request-Id`` to the response's headers.
    A malformed header is answered with a 400 that carries a new id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        values = [v for k, v in scope.get("headers", ()) if k == _HEADER_BYTES]
        try:
            given = parse_header(values)
        except APIError as err:
            state[STATE_KEY] = new_id()
            await err.response()(scope, receive, self._sender(send, state))
            return
        state[STATE_KEY] = given if given is not None else new_id()
        state[_FROM_CLIENT] = given is not None
        await self.app(scope, receive, self._sender(send, state))

    @staticmethod
    def _sender(send, state: dict):
        async def wrapped(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != _HEADER_BYTES]
                headers.append((_HEADER_BYTES, str(state[STATE_KEY]).encode("latin-1")))
                message = dict(message, headers=headers)
            await send(message)

        return wrapped
