"""vLLM's small routes that scripts and hosting platforms call (``server/app.py`` routes them):

- ``POST /invocations``: SageMaker's single entry point. As vLLM does, the body's shape picks
  the endpoint: ``messages`` -> ``/v1/chat/completions``, else ``prompt`` ->
  ``/v1/completions`` (vLLM tries the chat model first, then the completion one). vLLM sends
  an ``input`` body to its embedding (pooling) endpoints, which ferry has not got: such a body
  is a 400, like any other shape, naming what is expected.
- ``GET``/``POST /ping``: SageMaker's health check: ``/health``'s answer (200, or 503 while the
  engine is dead or the server stops); no API key needed, as ``/health``.
- ``GET /version``: ``{"version": ferry's package version}``.
- ``GET /load``: vLLM's server-load figure ``{"server_load": N}``: the engine requests the
  HTTP front end waits on now (each choice of ``n`` counts; every replica of ``--dp-size``).
"""

from __future__ import annotations

import importlib.metadata

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from server.http.body import read_json
from server.http.errors import bad_request
from server.openai.serving import OpenAIServing

#: the body key that picks each endpoint, in vLLM's order of trial
INVOCATION_SHAPES = (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions"))


def version() -> str:
    """ferry's installed package version ("0.0.0" when it runs from a tree not installed)."""
    try:
        return importlib.metadata.version("ferry")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def load_of(serving: OpenAIServing) -> dict:
    """``GET /load``: ``{"server_load": engine requests in flight}``."""
    return {"server_load": serving.tm.num_inflight}


def _replay(request: Request, body: bytes) -> Request:
    """``request`` with its body readable again (the first ``receive`` gives ``body``; the
    later ones are the connection's, so a disconnect is still seen)."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


async def invocations(serving: OpenAIServing, request: Request) -> Response:
    """``POST /invocations``: the chat or completions answer of the body, by its shape.

    Raises:
        APIError: as ``read_json`` (413, 415, 408, 400 for a body that is not JSON), 400
            naming the body when it has neither ``messages`` nor ``prompt``, and then every
            error of the endpoint it goes to.
    """
    body = await read_json(request, serving.args.max_request_bytes,
                           serving.args.body_read_timeout)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key, path in INVOCATION_SHAPES:
        if key in body:
            replay = _replay(request, msgspec.json.encode(body))
            if path == "/v1/chat/completions":
                return await serving.chat(replay)
            return await serving.completions(replay)
    what = " or ".join(f"'{k}' ({p})" for k, p in INVOCATION_SHAPES)
    extra = "; 'input' bodies go to embeddings in vLLM: ferry answers them at POST " \
        "/v1/embeddings of an embedding server (the Responses API is POST /v1/responses)" \
        if "input" in body else ""
    raise bad_request(f"/invocations routes a body by its shape: it needs {what}{extra}")
