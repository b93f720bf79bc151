"""Anthropic's errors on the Messages routes: ``{"type": "error", "error": {"type",
"message"}}`` with Anthropic's status codes, and the ``anthropic-version`` header.

ferry's ``APIError`` (``server/http/errors.py``) is what every layer raises; on
``/v1/messages`` and ``/v1/messages/count_tokens`` (``is_messages_path``) it is answered in
Anthropic's shape instead of OpenAI's. Statuses and types (Anthropic's table):

- 400 ``invalid_request_error`` (and 405, 408, 415: still the client's request),
- 401 ``authentication_error``, 403 ``permission_error``, 404 ``not_found_error``,
- 413 ``request_too_large``, 429 ``rate_limit_error``,
- 503 (ferry's overload: the queue is full, the server is stopping) -> 529
  ``overloaded_error``, which the ``anthropic`` SDK retries like Anthropic's,
- any other 5xx -> 500 ``api_error``.

The message keeps ferry's text with the field at fault (``param``) named in it when the text
does not already: Anthropic's error object has no ``param``.

``anthropic-version`` is required, as on Anthropic's API (the official SDKs always send
it). ``KNOWN_VERSIONS`` are the versions ferry has been checked against (the ``anthropic``
SDK 2.16 sends ``2026-10-21``); another well-formed version (a date ``YYYY-MM-DD`` from
2023-01-01 on, e.g. a newer SDK's) is accepted too, since the shapes ferry implements are
the same in all of them; anything else is a 400. ``anthropic-beta`` is accepted
and ignored (its features are the body's fields, each implemented, a no-op or a 400).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import date

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from server.http.errors import APIError

logger = logging.getLogger("ferry.server")

#: the API versions Anthropic documents (``anthropic-version``)
KNOWN_VERSIONS = frozenset({"2023-01-01", "2023-06-01", "2026-10-21"})
#: the first API version
FIRST_VERSION = "2023-01-01"
#: the routes of this family (their errors are Anthropic-shaped)
MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

#: ferry's status -> (Anthropic's status, error type)
_BY_STATUS = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    405: (405, "invalid_request_error"),
    408: (408, "invalid_request_error"),
    413: (413, "request_too_large"),
    415: (415, "invalid_request_error"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),
}


def is_messages_path(path: str | None) -> bool:
    """Whether ``path`` is one of this family's routes (a trailing slash included)."""
    return path is not None and path.rstrip("/") in MESSAGES_PATHS


def status_and_type(status: int) -> tuple[int, str]:
    """Anthropic's status and error type of a ferry status."""
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return (status, "invalid_request_error") if status < 500 else (500, "api_error")


def error_object(err: APIError) -> dict:
    """The ``{"type": "error", "error": {...}}`` body of ``err`` (the stream's ``error``
    event carries the same)."""
    _, kind = status_and_type(err.status)
    msg = err.message
    if err.param and err.param not in msg:
        msg = f"{err.param}: {msg}"
    return {"type": "error", "error": {"type": kind, "message": msg}}


def error_response(err: APIError) -> JSONResponse:
    """``err`` as Anthropic answers it (status, body, ``err.headers``)."""
    status, _ = status_and_type(err.status)
    return JSONResponse(error_object(err), status_code=status, headers=err.headers)


def error_event(err: APIError) -> str:
    """``err`` as a stream's ``event: error`` (after the first event of a stream)."""
    data = json.dumps(error_object(err), ensure_ascii=False, separators=(",", ":"))
    return f"event: error\ndata: {data}\n\n"


def check_version(request: Request) -> None:
    """Raises: APIError 400 for a missing ``anthropic-version`` header, or a malformed one
    (see the module docstring)."""
    version = request.headers.get("anthropic-version")
    if version is None:
        raise APIError("anthropic-version: header is required (e.g. 'anthropic-version: "
                       "2023-06-01')", 400, "anthropic-version")
    version = version.strip()
    if version in KNOWN_VERSIONS:
        return
    try:
        ok = len(version) == 10 and version >= FIRST_VERSION and \
            date.fromisoformat(version).isoformat() == version
    except ValueError:
        ok = False
    if not ok:
        raise APIError(f"anthropic-version: invalid version {version[:40]!r} (a date "
                       f"YYYY-MM-DD, e.g. one of {', '.join(sorted(KNOWN_VERSIONS))})", 400,
                       "anthropic-version")


def messages_endpoint(fn: Callable[[Request], Awaitable[Response]]):
    """Wrap a Messages handler: ``anthropic-version`` checked; ``APIError`` -> Anthropic's
    error response; anything else -> logged, a shaped 500 ``api_error``."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            check_version(request)
            return await fn(request)
        except APIError as err:
            return error_response(err)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            logger.exception("unhandled error in %s %s", request.method, request.url.path)
            return error_response(APIError("internal server error", 500))

    return wrapper
