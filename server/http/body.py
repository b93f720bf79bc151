"""Reading a request's JSON body: its size, type and arrival time bounded, strict JSON.

``read_json`` is the one reader of every route that takes a body (the generation endpoints,
``/v1/responses``, the LoRA and vLLM routes).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import msgspec
from starlette.requests import Request

from server.http.errors import APIError, bad_request, http_error

#: default seconds a client has to send the whole request body (headers already in); a
#: client that stalls gets a 408 and the connection is closed (``--body-read-timeout``)
BODY_READ_TIMEOUT_S = 30.0

#: a \\u escape of a UTF-16 surrogate (D800-DFFF)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


async def _read_body(request: Request, max_bytes: int) -> bytearray:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise http_error(413, f"the request body is larger than {max_bytes} bytes")
    return body


def check_json_content_type(value: str | None) -> None:
    """Raises: APIError 415 unless ``value`` (a Content-Type header) is application/json."""
    media = (value or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = f"'{value}'" if value else "none"
        raise APIError(f"the request body must be JSON sent with 'Content-Type: "
                       f"application/json' (got {got})", 415, None,
                       "unsupported_media_type")


async def read_json(request: Request, max_bytes: int,
                    timeout_s: float | None = None) -> Any:
    """The decoded JSON body.

    Args:
        request: the request (its body not read yet).
        max_bytes: the largest accepted body.
        timeout_s: seconds the whole body may take to arrive (default BODY_READ_TIMEOUT_S).
    Raises:
        APIError: 413 if the body exceeds ``max_bytes`` (by Content-Length or as received);
            415 unless ``Content-Type`` is ``application/json`` (parameters such as
            ``charset=utf-8`` allowed; a missing type is refused too: browsers send
            ``text/plain`` and untyped bodies cross-origin without a CORS preflight);
            408 (``Connection: close``) if it has not all arrived within ``timeout_s``;
            400 if it is empty, not strict JSON (NaN, invalid UTF-8 and lone surrogates are
            refused: the tokenizer cannot take them) or nested deeper than the decoder
            allows (about 1000 levels). Decoding raises nothing else.
    """
    check_json_content_type(request.headers.get("content-type"))
    cl = request.headers.get("content-length")
    if cl is not None:
        if not cl.isascii() or not cl.strip().isdigit():
            raise bad_request("invalid Content-Length header")
        if int(cl) > max_bytes:
            raise http_error(413, f"the request body is larger than {max_bytes} bytes")
    timeout_s = BODY_READ_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            body = await _read_body(request, max_bytes)
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout_s:g} s", 408, None,
                       "request_timeout", headers={"Connection": "close"}) from None
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    try:  # strict JSON: no NaN/Infinity, valid UTF-8, no lone surrogates
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise bad_request(_not_json(bytes(body), exc)) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - whatever the decoder raises, the body is bad
        raise bad_request(f"the request body could not be decoded ({type(exc).__name__})"
                          ) from None


def _not_json(body: bytes, exc: Exception) -> str:
    """Why a body msgspec refused is not strict JSON: Python's laxer decoder tells the two
    cases msgspec words obscurely (a lone surrogate escape: "Input data was truncated";
    ``NaN``/``Infinity``: "invalid character") from plain syntax errors."""
    constants: list[str] = []
    try:
        json.loads(body, parse_constant=constants.append)
    except (ValueError, RecursionError):
        return f"the request body is not valid JSON: {exc}"
    if constants:
        return f"the request body is not valid JSON: {constants[0]} is not a JSON number"
    if "truncated" in str(exc) and _SURROGATE.search(body):  # msgspec's word for it
        return ("the request body is not valid JSON: a \\uD800-\\uDFFF escape without its "
                "pair (a lone UTF-16 surrogate) encodes no character")
    return f"the request body is not valid JSON: {exc}"
