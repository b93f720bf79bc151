"""``GET /openapi.json`` (OpenAPI 3.1) and ``GET /docs`` (Swagger UI).

The document is built from the app's route table and the pydantic models: every route's
path and methods come from ``app.routes``; its request and response bodies from
``OPERATIONS`` (the request models of ``server/openai/protocol.py``, the response models of
``server/openapi/models.py``), turned into JSON schemas by pydantic
(``models_json_schema``). The fields the routes read outside the request models
(structured output, tools, accepted no-ops, message fields) come from the ``*Fields`` models
of ``server/openapi/models.py`` and are merged into the request schemas, which then forbid
anything else, as the server does. A route missing from ``OPERATIONS`` is still listed,
with a generic answer. Every operation documents the OpenAI error body for its error
statuses and the ``X-Request-Id`` header (``server/http/request_id.py``).
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from server.anthropic.errors import KNOWN_VERSIONS
from server.anthropic.request import CountTokensRequest, MessagesRequest
from server.http.request_id import HEADER as REQUEST_ID
from server.http.request_id import MAX_REQUEST_ID_LEN
from server.openai import extensions
from server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.openapi import models as om
from server.pooling import protocol as pooling

#: errors of a generation request: bad body or X-Request-Id, key, model, slow body, size,
#: media type, queue full / engine gone
GENERATE_ERRORS = (400, 401, 404, 408, 413, 415, 503)
BODY_ERRORS = (400, 401, 404, 408, 413, 415)


@dataclass(frozen=True)
class Operation:
    """What one method of one route takes and answers.

    ``request``: the JSON body's model; ``response``: the 200 JSON body's model; ``stream``:
    the model of each ``data:`` event when the body asks for ``stream: true``; ``media``:
    the 200 media type when it is not JSON; ``errors``: statuses answered with
    ``ErrorResponse``; ``auth``: whether ``--api-key`` applies; ``generic``: a route
    OPERATIONS does not describe (its POST body is documented as a JSON object).
    """

    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    stream: type[BaseModel] | None = None
    media: str | None = None
    errors: tuple[int, ...] = (400, 401)
    auth: bool = True
    generic: bool = False  # a route missing from OPERATIONS (a POST takes a JSON object)
    anthropic: bool = False  # Anthropic's error body and status codes, anthropic-version


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/completions", "post"): Operation(
        "Create a completion", CompletionRequest, om.CompletionResponse,
        om.CompletionChunk, errors=GENERATE_ERRORS),
    ("/v1/chat/completions", "post"): Operation(
        "Create a chat completion", ChatCompletionRequest, om.ChatCompletionResponse,
        om.ChatCompletionChunk, errors=GENERATE_ERRORS),
    # the stored responses of the Responses API (server/responses/store.py)
    ("/v1/responses/{response_id}", "get"): Operation(
        "A stored response (404: unknown, expired or deleted)", media="application/json",
        errors=(400, 401, 404)),
    ("/v1/responses/{response_id}", "delete"): Operation(
        "Delete a stored response", media="application/json", errors=(400, 401, 404)),
    ("/v1/responses/{response_id}/input_items", "get"): Operation(
        "The input items of a stored response", media="application/json",
        errors=(400, 401, 404)),
    ("/v1/responses/{response_id}/cancel", "post"): Operation(
        "Cancel a background response", media="application/json", errors=(400, 401, 404)),
    # Anthropic's Messages API (server/anthropic/): its errors, 503 answered as 529
    ("/v1/messages", "post"): Operation(
        "Create a message (Anthropic's Messages API)", MessagesRequest, om.AnthropicMessage,
        errors=(400, 401, 404, 408, 413, 415, 529), anthropic=True),
    ("/v1/messages/count_tokens", "post"): Operation(
        "Count the prompt tokens of a message request", CountTokensRequest,
        om.AnthropicTokenCount, errors=(400, 401, 404, 408, 413, 415), anthropic=True),
    ("/v1/tokenize", "post"): Operation("Tokenize a prompt or messages", TokenizeRequest,
                                        om.TokenizeResponse, errors=BODY_ERRORS),
    ("/v1/detokenize", "post"): Operation("Detokenize token ids", DetokenizeRequest,
                                          om.DetokenizeResponse, errors=BODY_ERRORS),
    ("/tokenize", "post"): Operation("Tokenize (vLLM's path)", TokenizeRequest,
                                     om.TokenizeResponse, errors=BODY_ERRORS),
    ("/detokenize", "post"): Operation("Detokenize (vLLM's path)", DetokenizeRequest,
                                       om.DetokenizeResponse, errors=BODY_ERRORS),
    ("/v1/models", "get"): Operation("List the served model", response=om.ModelList),
    ("/v1/models/{model_id}", "get"): Operation("The served model", response=om.ModelCard,
                                                errors=(400, 401, 404)),
    ("/health", "get"): Operation("Liveness (200) or not (503)", response=om.HealthResponse,
                                  errors=(400, 503), auth=False),
    ("/server_info", "get"): Operation("Engine and server figures", response=om.ServerInfo,
                                       errors=(400, 401, 503)),
    # SGLang's routes, for its routers and their health checks (server/openai/native.py)
    ("/get_server_info", "get"): Operation("/server_info (SGLang's path)",
                                           response=om.ServerInfo, errors=(400, 401, 503)),
    ("/model_info", "get"): Operation("The model's path, tokenizer path and kind (SGLang's)",
                                      response=om.ModelInfo),
    ("/get_model_info", "get"): Operation("/model_info (SGLang's older path)",
                                          response=om.ModelInfo),
    ("/health_generate", "get"): Operation("200 once the engine generated a token, else 503",
                                           response=om.HealthResponse, errors=(400, 401, 503)),
    ("/get_load", "get"): Operation("Running and waiting requests (SGLang's shape)",
                                    response=om.LoadList, errors=(400, 401, 503)),
    # vLLM's small routes (server/openai/vllm_routes.py)
    ("/invocations", "post"): Operation(
        "SageMaker's entry point: a chat body (messages) or a completions body (prompt), "
        "answered as /v1/chat/completions or /v1/completions", errors=GENERATE_ERRORS,
        generic=True),
    ("/ping", "get"): Operation("SageMaker's health check: /health's answer",
                                response=om.HealthResponse, errors=(400, 503), auth=False),
    ("/ping", "post"): Operation("SageMaker's health check: /health's answer",
                                 response=om.HealthResponse, errors=(400, 503), auth=False),
    ("/version", "get"): Operation("ferry's version", response=om.VersionResponse),
    ("/load", "get"): Operation("vLLM's server load: engine requests in flight",
                                response=om.ServerLoad),
    ("/metrics", "get"): Operation("Prometheus metrics", media="text/plain",
                                   errors=(400, 503), auth=False),
    ("/flush_cache", "post"): Operation("Empty the prefix cache (400 while requests run)",
                                        response=om.FlushCacheResponse,
                                        errors=(400, 401, 503)),
    # pooling models (server/pooling/): a generation server answers them 400, as a pooling
    # server answers the generation routes
    ("/v1/embeddings", "post"): Operation(
        "Create embeddings (an embedding model)", pooling.EmbeddingRequest,
        pooling.EmbeddingResponse, errors=GENERATE_ERRORS),
    ("/v1/rerank", "post"): Operation(
        "Rerank documents against a query (a scoring model), best first",
        pooling.RerankRequest, pooling.RerankResponse, errors=GENERATE_ERRORS),
    ("/rerank", "post"): Operation("/v1/rerank (Jina's and Cohere's path)",
                                   pooling.RerankRequest, pooling.RerankResponse,
                                   errors=GENERATE_ERRORS),
    ("/v1/score", "post"): Operation(
        "Score text pairs (a scoring model; vLLM's shape)", pooling.ScoreRequest,
        pooling.ScoreResponse, errors=GENERATE_ERRORS),
    ("/openapi.json", "get"): Operation("This document", media="application/json",
                                        errors=(400,), auth=False),
    ("/docs", "get"): Operation("Swagger UI of this document", media="text/html",
                                errors=(400,), auth=False),
}

#: schema name -> models whose properties the routes also read (merged in; then nothing
#: else is accepted)
OVERLAYS: dict[str, tuple[type[BaseModel], ...]] = {
    "CompletionRequest": (om.StructuredFields, om.NoopFields),
    "ChatCompletionRequest": (om.StructuredFields, om.ToolFields, om.NoopFields),
    "TokenizeRequest": (om.TokenizeFields,),
    "ChatMessage": (om.ChatMessageDoc,),
}
_PATH_PARAM = re.compile(r"{(\w+)(?::\w+)?}")


@dataclass(frozen=True)
class ServerFacts:
    """What the document states about this server: ``--max-n`` (the bound of ``n``),
    whether ``--api-key`` is set (then a bearer scheme), the model names ``model`` may
    take, and the vocabulary size (the bound of token ids)."""

    max_n: int | None = None
    api_key: bool = False
    models: tuple[str, ...] = ()
    vocab_size: int | None = None


def _bound_token_ids(schema: dict, vocab_size: int) -> None:
    """Every ``{"type": "integer"}`` under ``schema`` (a list of token ids) gets the bounds
    ``[0, vocab_size)``."""
    if schema.get("type") == "integer":
        schema.update(minimum=0, maximum=vocab_size - 1)
    subs = [*schema.get("anyOf", ()), *([schema["items"]] if "items" in schema else [])]
    for sub in subs:
        _bound_token_ids(sub, vocab_size)


def _apply_facts(schemas: dict, facts: ServerFacts) -> None:
    """Bounds only this server knows: n, the model names, token ids."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        if facts.max_n:  # a larger n is a 400
            schemas[name]["properties"]["n"]["maximum"] = facts.max_n
    for name, schema in schemas.items():
        model = schema.get("properties", {}).get("model")
        if name.endswith("Request") and model is not None and facts.models:
            model["anyOf"] = [{"enum": list(facts.models)}, {"type": "null"}]
    if facts.vocab_size:
        for name, field in (("CompletionRequest", "prompt"),
                            ("CompletionRequest", "stop_token_ids"),
                            ("ChatCompletionRequest", "stop_token_ids"),
                            ("DetokenizeRequest", "tokens")):
            _bound_token_ids(schemas[name]["properties"][field], facts.vocab_size)


def _component_schemas(facts: ServerFacts) -> dict:
    """Every model's JSON schema, by name (refs point into ``#/components/schemas``)."""
    models = {op.request for op in OPERATIONS.values()} | {
        op.response for op in OPERATIONS.values()} | {op.stream for op in OPERATIONS.values()}
    models |= {om.ErrorResponse, om.AnthropicErrorResponse, *(m for ms in OVERLAYS.values() for m in ms)}
    models.discard(None)
    ordered = sorted(models, key=lambda m: m.__name__)
    _, defs = models_json_schema([(m, "validation") for m in ordered],
                                 ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]
    for name, extras in OVERLAYS.items():
        target = schemas[name]
        for model in extras:
            extra = schemas[model.__name__]
            target["properties"].update(extra["properties"])
            target.update({k: v for k, v in extra.items() if k in ("anyOf", "oneOf")})
        target["additionalProperties"] = False
    for name in ("CompletionRequest", "ChatCompletionRequest"):  # SGLang's and vLLM's
        schemas[name]["properties"].update(extensions.json_schemas())
    for model in {m for ms in OVERLAYS.values() for m in ms}:
        del schemas[model.__name__]  # merged: no route refers to them
    _apply_facts(schemas, facts)
    return schemas


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


_ID_HEADER = {REQUEST_ID: {
    "description": "the request's id: the client's X-Request-Id, else the one the server "
                   "made (the body's id on the generation routes)",
    "required": True, "schema": {"type": "string"}}}


def _error(status: int, anthropic: bool = False) -> dict:
    schema = _ref(om.AnthropicErrorResponse if anthropic else om.ErrorResponse)
    if anthropic and status == 400:  # a malformed X-Request-Id is refused before the route
        schema = {"anyOf": [schema, _ref(om.ErrorResponse)]}
    phrase = "Overloaded" if status == 529 else HTTPStatus(status).phrase
    return {"description": phrase, "headers": _ID_HEADER,
            "content": {"application/json": {"schema": schema}}}


def _sse(model: type[BaseModel]) -> dict:
    """One server-sent event: ``data:`` a chunk, an error, or the final ``[DONE]``."""
    data = {"anyOf": [{"const": "[DONE]"},
                      {"contentMediaType": "application/json",
                       "contentSchema": {"anyOf": [_ref(model), _ref(om.ErrorResponse)]}}]}
    return {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}


def _operation(path: str, method: str, op: Operation, params: list[dict],
               security: bool) -> dict:
    out: dict = {"summary": op.summary, "operationId": f"{method}_{path}",
                 "parameters": [*params, {
                     "name": REQUEST_ID, "in": "header", "required": False,
                     "description": "names the request (echoed in the response)",
                     "schema": {"type": "string",
                                "pattern": f"^[!-~]{{1,{MAX_REQUEST_ID_LEN}}}$"}}]}
    if op.request is not None or (method == "post" and op.generic):
        schema = _ref(op.request) if op.request is not None else {"type": "object"}
        out["requestBody"] = {"required": True,
                              "content": {"application/json": {"schema": schema}}}
    ok: dict = {"description": "OK", "headers": _ID_HEADER}
    if op.response is not None:
        ok["content"] = {"application/json": {"schema": _ref(op.response)}}
    elif op.media is not None:
        ok["content"] = {op.media: {"schema": {"type": "object"} if op.media ==
                                    "application/json" else {"type": "string"}}}
    if op.stream is not None:
        ok["content"]["text/event-stream"] = _sse(op.stream)
    if op.anthropic:  # its events (server/anthropic/events.py); the version header
        if path == "/v1/messages":
            ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
        out["parameters"].append({"name": "anthropic-version", "in": "header",
                                  "required": True,
                                  "schema": {"type": "string", "enum": sorted(KNOWN_VERSIONS)}})
    out["responses"] = {"200": ok, **{str(s): _error(s, op.anthropic) for s in op.errors
                                      if s != 401 or op.auth}}
    if security:
        out["security"] = [{"bearerAuth": []}] if op.auth else []
    return out


def _options(params: list[dict]) -> dict:
    allow = {"Allow": {"description": "the route's methods", "schema": {"type": "string"}}}
    return {"summary": "The route's methods; a CORS preflight from an allowed origin",
            "parameters": [dict(p, schema={"type": "string"}) for p in params],
            "responses": {"204": {"description": "No Content", "headers": allow},
                          "400": _error(400),
                          # a path parameter the route's pattern refuses (a newline)
                          "404": _error(404)}}


def build_openapi(routes, *, title: str = "ferry", version: str = "0.1.0",
                  facts: ServerFacts | None = None) -> dict:
    """The OpenAPI 3.1 document of ``routes`` (Starlette ``Route`` objects).

    Args:
        routes: the app's routes (``app.routes``).
        title, version: ``info``.
        facts: ``ServerFacts`` (bounds of this server; none by default).
    """
    facts = facts or ServerFacts()
    paths: dict[str, dict] = {}
    for route in routes:
        if not isinstance(route, Route) or not route.include_in_schema:
            continue
        path = _PATH_PARAM.sub(r"{\1}", route.path)
        params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in _PATH_PARAM.findall(route.path)]
        for p in params:  # GET /v1/models/{model_id}: another name is a 404
            if p["name"] == "model_id" and facts.models:
                p["schema"]["enum"] = list(facts.models)
        item = paths.setdefault(path, {})
        for method in sorted(m.lower() for m in (route.methods or ()) if m != "HEAD"):
            op = OPERATIONS.get((path, method)) or Operation(
                route.name or path, errors=(400, 401, 404, 408, 413, 415, 503), generic=True)
            item[method] = _operation(path, method, op, params, facts.api_key)
        item.setdefault("options", _options(params))
    doc = {"openapi": "3.1.0",
           "info": {"title": title, "version": version,
                    "description": "ferry's OpenAI-compatible API. Errors are "
                                   "{\"error\": {\"message\", \"type\", \"param\", \"code\"}}. "
                                   "Types are strict: an integer field takes JSON integers "
                                   "only (1.0 is a 400), a boolean JSON booleans only."},
           "paths": paths,
           "components": {"schemas": _component_schemas(facts)}}
    if facts.api_key:
        doc["components"]["securitySchemes"] = {"bearerAuth": {"type": "http",
                                                               "scheme": "bearer"}}
    return doc


DOCS_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title} - API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css">
</head><body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({{url: "{url}", dom_id: "#swagger-ui"}});</script>
</body></html>
"""


def openapi_routes(title: str, facts: Callable[[], ServerFacts], version: str = "0.1.0",
                   wrap=lambda fn: fn) -> list[Route]:
    """``GET /openapi.json`` (built on first use from the app's routes and ``facts()``)
    and ``GET /docs``, their handlers passed through ``wrap`` (the app's error wrapper)."""
    cache: dict[str, dict] = {}

    async def openapi_json(request: Request) -> Response:
        if "doc" not in cache:
            cache["doc"] = build_openapi(request.app.routes, title=title, version=version,
                                         facts=facts())
        return JSONResponse(cache["doc"])

    async def docs(request: Request) -> Response:
        return HTMLResponse(DOCS_HTML.format(title=html.escape(title), url="openapi.json"))

    return [Route("/openapi.json", wrap(openapi_json), methods=["GET"]),
            Route("/docs", wrap(docs), methods=["GET"])]
