"""CORS (``--allowed-origins``, ``--allowed-headers``, ``--allowed-methods``) and ``OPTIONS``.

Built on Starlette's ``CORSMiddleware``: an origin in ``--allowed-origins`` (exact, ``*`` for
any, or with ``*`` as its port: ``http://localhost:*`` matches ``http://localhost`` and any
port, through ``allow_origin_regex``) gets the ``Access-Control-Allow-*`` headers, its
preflight a 204. Any other origin gets no CORS header at all (the browser then blocks the
call): its requests, its preflight included, go on as if they had no ``Origin``. A preflight
from an allowed origin for a method or header that is not allowed is an OpenAI-shaped 400.

``OptionsMiddleware`` answers an ``OPTIONS`` request to a route that exists (no ``Origin``,
or an origin that is not allowed) with 204 and an ``Allow`` header, never 405; an unknown
path stays a 404. Both sit before the API-key check: a browser's preflight carries no key.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.routing import Match

from server.http.errors import APIError
from server.http.request_id import HEADER as REQUEST_ID_HEADER

_ORIGIN = re.compile(r"(?P<base>[a-z][a-z0-9+.-]*://(?:\[[0-9a-f:.]+\]|[^/:*\s\[\]@]+))"
                     r"(?::(?P<port>[0-9]{1,5}|\*))?/?")


def split_list(value: str | None) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def parse_origins(value: str | None) -> tuple[list[str], str | None]:
    """``--allowed-origins`` as Starlette's ``(allow_origins, allow_origin_regex)``.

    ``"*"`` (alone or in the list) -> ``(["*"], None)``; ``"http://a:*"`` becomes the regex
    ``http://a(?::[0-9]+)?``; other entries are exact origins (lower-cased, a trailing ``/``
    dropped).

    Raises:
        ValueError: an entry that is not ``scheme://host[:port]`` with port digits or ``*``.
    """
    items = split_list(value)
    if "*" in items:
        return ["*"], None
    exact, patterns = [], []
    for item in items:
        m = _ORIGIN.fullmatch(item.lower())
        if m is None:
            raise ValueError(f"--allowed-origins: {item!r} is not an origin "
                             "(scheme://host[:port], the port may be '*'; or '*' for any)")
        if m["port"] == "*":
            patterns.append(re.escape(m["base"]) + r"(?::[0-9]+)?")
        else:
            exact.append(m["base"] + (f":{m['port']}" if m["port"] else ""))
    regex = "|".join(f"(?:{p})" for p in patterns) or None
    return exact, regex


def cors_options(args) -> dict | None:
    """Keyword arguments of ``CORSMiddleware`` from the ``ServerArgs``, or None when no
    origin is allowed (then no CORS middleware is installed).

    Raises:
        ValueError: a malformed ``--allowed-origins`` entry.
    """
    origins, regex = parse_origins(args.allowed_origins)
    if not origins and regex is None:
        return None
    methods = [m.upper() for m in split_list(args.allowed_methods)]
    return {"allow_origins": origins, "allow_origin_regex": regex,
            "allow_methods": methods, "allow_headers": split_list(args.allowed_headers),
            "allow_credentials": False, "expose_headers": [REQUEST_ID_HEADER],
            "max_age": 600}


class FerryCORSMiddleware(CORSMiddleware):
    """Starlette's ``CORSMiddleware`` that leaves requests from other origins alone (no
    CORS header, their preflight answered by ``OptionsMiddleware``), answers a granted
    preflight with 204 and a refused one (method, headers) with an OpenAI-shaped 400."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            origin = Headers(scope=scope).get("origin")
            if origin is not None and not self.is_allowed_origin(origin):
                await self.app(scope, receive, _vary_origin(send))
                return
        await super().__call__(scope, receive, send)

    def preflight_response(self, request_headers: Headers) -> Response:
        """204 with the ``Access-Control-Allow-*`` headers, or a 400 naming the failure."""
        res = super().preflight_response(request_headers)
        headers = {k: v for k, v in res.headers.items()
                   if k.lower() not in ("content-length", "content-type")}
        if res.status_code < 400:
            return Response(status_code=204, headers=headers)
        return APIError(f"{res.body.decode()} (see --allowed-methods and --allowed-headers)",
                        400, None, "cors_preflight_refused", headers=headers).response()


def _vary_origin(send):
    """``send`` that adds ``Vary: Origin`` (the answer depends on the origin) to the
    response headers."""

    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", ()),
                                             (b"vary", b"Origin")])
        await send(message)

    return wrapped


def allowed_methods(routes, scope) -> list[str]:
    """Methods of the routes whose path matches ``scope``'s (empty: no such route)."""
    methods: set[str] = set()
    for route in routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


class OptionsMiddleware:
    """Answers ``OPTIONS`` on an existing route with 204 and ``Allow`` (the route's methods
    and OPTIONS); other requests, and OPTIONS on unknown paths, go on to the app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            router = getattr(scope.get("app"), "router", None)
            methods = allowed_methods(getattr(router, "routes", ()), scope)
            if methods and "OPTIONS" not in methods:
                allow = ", ".join([*methods, "OPTIONS"])
                await Response(status_code=204, headers={"Allow": allow})(scope, receive,
                                                                           send)
                return
        await self.app(scope, receive, send)
