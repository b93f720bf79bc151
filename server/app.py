"""The Starlette application: routes, API-key check and OpenAI-shaped errors everywhere.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/tokenize`` and
``POST /v1/detokenize`` (also at ``/tokenize`` and ``/detokenize``, vLLM's paths),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /server_info``,
``GET /metrics``, ``POST /flush_cache`` (empties the prefix cache; 400 while requests run),
SGLang's routes its routers ask (``GET /get_server_info``, ``/model_info``,
``/get_model_info``, ``/health_generate``, ``/get_load``: ``server/openai/native.py``),
vLLM's small routes (``POST /invocations``, ``GET``/``POST /ping``, ``GET /version``,
``GET /load``: ``server/openai/vllm_routes.py``), the stored responses of the Responses API
(``GET``/``DELETE /v1/responses/{id}``, ``.../input_items``, ``POST .../cancel``),
Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``
(``server/anthropic/``, with Anthropic-shaped errors, its 401, 404 and 405 included),
``GET /openapi.json`` and ``GET /docs`` (``server/openapi/spec.py``), and the pooling
routes of an embedding or scoring model (``POST /v1/embeddings``, ``/v1/rerank``, ``/rerank``,
``/v1/score``: ``server/pooling/serving.py``; a pooling server refuses the generation routes
and a generation server these, with a 400 naming the route). ``OPTIONS`` on a route
answers 204 (CORS preflights included, ``server/http/cors.py``); every response carries
``X-Request-Id`` (``server/http/request_id.py``). Every handler is wrapped so an unexpected
exception still answers an OpenAI-shaped error (and logs the traceback); unknown routes
(404, a trailing slash included: no redirects) and wrong methods (405) are shaped too.

By responsibility: ``endpoint`` (the wrapper of every handler), ``AuthMiddleware`` and
``middleware_of`` (the middleware stack), ``ServerRoutes`` (the handlers of the server's own
routes, and the hand-off to the endpoint families), ``SERVER_ROUTES``/``route_table`` (the
route table), ``http_exception``/``server_error`` (the error handlers), ``build_app``
(their assembly). The process's start and stop (the lifespan) are ``server/launch.py``'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.args import request_body_limit
from server.anthropic.errors import error_response, is_messages_path, messages_endpoint
from server.anthropic.serving import MessagesServing
from server.http.cors import FerryCORSMiddleware, OptionsMiddleware, cors_options
from server.http.errors import APIError, http_error
from server.http.request_id import STATE_KEY as REQUEST_ID_KEY
from server.http.request_id import RequestIdMiddleware
from server.openai import lora, native, tokens
from server.openai.serving import OpenAIServing
from server.openai.vllm_routes import invocations as invoke
from server.openai.vllm_routes import load_of as server_load
from server.openai.vllm_routes import version as ferry_version
from server.openapi.spec import ServerFacts, openapi_routes
from server.pooling.serving import GENERATION_PATHS, PoolingServing, route_guard
from server.replicas import replica_metrics, replica_pids, replica_status
from server.responses.serving import ResponsesServing
from server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("ferry.server")

#: paths that stay open when --api-key is set (OPTIONS is answered before the key check)
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/openapi.json", "/docs"})
#: seconds /health_generate waits for its one generated token (then 503)
HEALTH_GENERATE_TIMEOUT_S = 20.0


def endpoint(fn: Callable[[Request], Awaitable[Response]]):
    """Wrap a handler: ``APIError`` -> its response; anything else -> logged, shaped 500."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as err:
            return err.response()
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            logger.exception("unhandled error in %s %s (request %s)", request.method,
                             request.url.path, request.scope.get("state", {}).get(
                                 REQUEST_ID_KEY))
            return http_error(500, "internal server error").response()

    return wrapper


class AuthMiddleware:
    """Pure ASGI middleware: ``Authorization: Bearer <api_key>`` or Anthropic's
    ``x-api-key: <api_key>`` on everything but OPEN_PATHS (the Messages routes answer a
    refusal in Anthropic's shape).

    Compares with ``secrets.compare_digest``; a request with both headers passes if
    either holds the key.
    """

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    def _authorized(self, scope) -> bool:
        ok = False
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                ok |= scheme.lower() == b"bearer" and secrets.compare_digest(
                    token.strip(), self.key)
            elif name == b"x-api-key":
                ok |= secrets.compare_digest(value.strip(), self.key)
        return ok

    async def __call__(self, scope, receive, send) -> None:
        if (self.key is not None and scope["type"] == "http"
                and scope.get("path") not in OPEN_PATHS and not self._authorized(scope)):
            err = APIError("Invalid or missing API key; send 'Authorization: Bearer <key>' "
                           "or 'x-api-key: <key>'", 401, None, "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            shaped = error_response(err) if is_messages_path(scope.get("path")) \
                else err.response()
            await shaped(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def refresh_engine_gauges(tm: TokenizerManager, timeout_s: float = 1.0) -> None:
    """Ask the engine for its running/waiting counts now (its answer sets the gauges), so
    ``/metrics`` shows the current values, not those of the last periodic report; the
    last ones stay if the engine does not answer within ``timeout_s`` (a long step)."""
    try:
        async with asyncio.timeout(timeout_s):
            await tm.router.server_info()
    except (TimeoutError, APIError):
        pass


def model_name_of(args) -> str:
    """The served model name: ``--served-model-name``, else derived from the model path.

    ``None`` (the embedded model) -> ``SmolLM2-135M-Instruct``; ``/m/Foo.Q4_K_M.gguf`` ->
    ``Foo``; a directory -> its base name.
    """
    if args.served_model_name:
        return args.served_model_name
    path = args.model_path
    if not path:
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(path))
    if name.lower().endswith(".gguf"):
        name = name[:-5]
        stem, dot, quant = name.rpartition(".")
        if dot and stem and (quant.upper().startswith(("Q", "IQ", "F16", "F32", "BF16"))):
            name = stem
    return name or path


class ServerRoutes:
    """The handlers of the routes ``app`` serves itself (models, health, server info,
    metrics, the prefix cache, LoRA adapters, SGLang's and vLLM's small routes), and the
    generation and tokenizer endpoints handed to their family.

    Args:
        tm: the started ``TokenizerManager``.
        args: ``ServerArgs``.
        serving: the ``OpenAIServing`` of the generation endpoints.
        children: ``{"engine": Process, "detokenizer": Process}`` (``engine-1``... per
            replica with ``--dp-size``); their pids are shown in ``/server_info``.
        responses: the ``ResponsesServing`` whose store's size ``/metrics`` shows, if any.
    """

    def __init__(self, tm: TokenizerManager, args, serving: OpenAIServing,
                 children: dict | None = None, responses: ResponsesServing | None = None):
        self.tm, self.args, self.serving = tm, args, serving
        self.responses = responses  # its store's size goes into /metrics
        self.model_name = serving.model_name
        self.created = int(time.time())
        self.children = children or {}
        # --dp-size: per replica {"engine": Process, "detokenizer": Process}
        self.replica_children = [{k.split("-")[0]: p for k, p in self.children.items()
                                  if (k.partition("-")[2] or "0") == str(i)}
                                 for i in range(len(tm.replicas))]

    def model_card(self) -> dict:
        ready = self.tm.engine_ready
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "ferry", "root": self.args.model_path or self.model_name,
                "max_model_len": ready.max_context_len if ready else None}

    # ---- the endpoint families -----------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self.serving.completions(request)

    async def chat(self, request: Request) -> Response:
        return await self.serving.chat(request)

    async def tokenize(self, request: Request) -> Response:
        return await tokens.tokenize(self.serving, request)

    async def detokenize(self, request: Request) -> Response:
        return await tokens.detokenize(self.serving, request)

    async def invocations(self, request: Request) -> Response:
        return await invoke(self.serving, request)

    # ---- models and adapters ------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]
                             + lora.adapter_cards(self.tm, self.model_name, self.created)})

    async def model(self, request: Request) -> Response:
        mid = request.path_params["model_id"]
        if mid in (self.model_name, self.args.model_path):
            return JSONResponse(self.model_card())
        for base in (self.model_name, self.args.model_path):  # SGLang's "base:adapter"
            if base and mid.startswith(base + ":"):
                name = mid[len(base) + 1:]
                for card in lora.adapter_cards(self.tm, self.model_name, self.created):
                    if card["id"] == name:  # as the generation routes accept it
                        return JSONResponse(dict(card, id=mid))
        for card in lora.adapter_cards(self.tm, self.model_name, self.created):
            if card["id"] == mid:
                return JSONResponse(card)
        raise APIError(f"The model '{mid}' does not exist", 404, "model", "model_not_found")

    async def load_lora_adapter(self, request: Request) -> Response:
        return await lora.change_adapter(self.serving, request, "load")

    async def unload_lora_adapter(self, request: Request) -> Response:
        return await lora.change_adapter(self.serving, request, "unload")

    async def model_info(self, request: Request) -> Response:
        info = native.model_info(self.args, self.model_name)
        info["has_image_understanding"] = self.tm.images is not None
        ready = self.tm.engine_ready
        if ready is not None and ready.pooling:  # an embedding or scoring model
            info["is_generation"] = False
        return JSONResponse(info)

    # ---- health and load ----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        tm = self.tm
        if tm.dead is not None:
            raise http_error(503, f"unhealthy: {tm.dead}")
        if tm.shutting_down:
            raise http_error(503, "the server is shutting down")
        if len(tm.replicas) == 1:
            return JSONResponse({"status": "ok"})
        # --dp-size: 200 while one replica lives ("degraded" once one died)
        degraded = any(not r.alive for r in tm.replicas)
        return JSONResponse({"status": "degraded" if degraded else "ok",
                             "replicas": replica_status(tm.replicas, self.replica_children)})

    async def health_generate(self, request: Request) -> Response:
        # /health's answer, as a response (not raised): a dead engine's or a stopping
        # server's 503 comes from the generation itself (its admission check)
        await endpoint(self.health)(request)
        await native.generate_one_token(self.tm, HEALTH_GENERATE_TIMEOUT_S)
        return JSONResponse({"status": "ok"})

    async def ping(self, request: Request) -> Response:
        return await self.health(request)

    async def get_load(self, request: Request) -> Response:
        return JSONResponse(native.load_of(await self.tm.router.server_infos()))

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": ferry_version()})

    async def load(self, request: Request) -> Response:
        return JSONResponse(server_load(self.serving))

    # ---- the engine's state -------------------------------------------------------------
    async def server_info(self, request: Request) -> Response:
        tm, args = self.tm, self.args
        info = msgspec.structs.asdict(await tm.router.server_info())
        info.pop("rid", None)  # the IPC message's id, nothing a client can use
        ready = tm.engine_ready
        info.update(native.model_info(args, self.model_name), **native.router_facts(args, ready))
        info["has_image_understanding"] = tm.images is not None
        info.update({
            "model": self.model_name, "device": ready.device, "dtype": ready.dtype,
            "kv_cache_dtype": ready.kv_cache_dtype, "quantization": args.quantization,
            "radix_cache": not args.disable_radix_cache, "schedule_policy": args.schedule_policy,
            "max_context_len": ready.max_context_len, "max_total_tokens":
            ready.max_total_tokens, "max_running_requests": ready.max_running_requests,
            "swa_total_tokens": ready.swa_total_tokens,
            "server_pid": os.getpid(),
            "engine_pid": getattr(self.children.get("engine"), "pid", None),
            "detokenizer_pid": getattr(self.children.get("detokenizer"), "pid", None),
            "num_inflight": tm.num_inflight, "shutting_down": tm.shutting_down,
        })
        if len(tm.replicas) > 1:  # the figures above are the replicas' sums
            info.update(dp_size=len(tm.replicas), load_balance_method=args.load_balance_method,
                        replicas=replica_status(tm.replicas, self.replica_children),
                        max_total_tokens=sum(r.ready["engine"].max_total_tokens
                                             for r in tm.replicas),
                        **replica_pids(self.replica_children))
        return JSONResponse(info)

    async def flush_cache(self, request: Request) -> Response:
        out = await self.tm.router.flush_cache()
        if not out.success:
            raise http_error(400, out.message)
        return JSONResponse({"message": out.message})

    async def metrics(self, request: Request) -> Response:
        tm = self.tm
        if tm.metrics is None:
            raise http_error(503, "metrics are not ready")
        await refresh_engine_gauges(tm)
        if self.responses is not None:
            tm.metrics.on_response_store(*self.responses.store.stats())
        body, content_type = tm.metrics.render()
        if len(tm.replicas) > 1:
            body += replica_metrics(tm.replicas, self.model_name)
        return Response(body, media_type=content_type)

    def facts(self) -> ServerFacts:
        """What ``/openapi.json`` states about this server."""
        args, ready = self.args, self.tm.engine_ready
        return ServerFacts(max_n=args.max_n, api_key=bool(args.api_key),
                           models=tuple(m for m in (self.model_name, args.model_path) if m),
                           vocab_size=ready.vocab_size if ready else None)


#: ``(path, ServerRoutes handler, methods)`` of every route ``ServerRoutes`` answers
SERVER_ROUTES = (
    ("/v1/completions", "completions", ["POST"]),
    ("/v1/chat/completions", "chat", ["POST"]),
    ("/v1/tokenize", "tokenize", ["POST"]),
    ("/v1/detokenize", "detokenize", ["POST"]),
    ("/tokenize", "tokenize", ["POST"]),
    ("/detokenize", "detokenize", ["POST"]),
    ("/v1/models", "models", ["GET"]),
    ("/v1/models/{model_id:path}", "model", ["GET"]),
    ("/health", "health", ["GET"]),
    ("/server_info", "server_info", ["GET"]),
    # what SGLang's routers and their health checks ask (server/openai/native.py)
    ("/get_server_info", "server_info", ["GET"]),
    ("/model_info", "model_info", ["GET"]),
    ("/get_model_info", "model_info", ["GET"]),
    ("/health_generate", "health_generate", ["GET"]),
    ("/get_load", "get_load", ["GET"]),
    # vLLM's: SageMaker's entry point and health check, the version, the server load
    ("/invocations", "invocations", ["POST"]),
    ("/ping", "ping", ["GET", "POST"]),
    ("/version", "version", ["GET"]),
    ("/load", "load", ["GET"]),
    ("/metrics", "metrics", ["GET"]),
    ("/flush_cache", "flush_cache", ["POST"]),
    # LoRA adapters at run time: SGLang's paths and vLLM's
    ("/load_lora_adapter", "load_lora_adapter", ["POST"]),
    ("/unload_lora_adapter", "unload_lora_adapter", ["POST"]),
    ("/v1/load_lora_adapter", "load_lora_adapter", ["POST"]),
    ("/v1/unload_lora_adapter", "unload_lora_adapter", ["POST"]),
)


def responses_routes(responses: ResponsesServing, tm: TokenizerManager) -> list[Route]:
    """``/v1/responses`` and its stored responses' routes."""
    create = route_guard(tm, "/v1/responses", responses.create)
    return [
        Route("/v1/responses", endpoint(create), methods=["POST"]),
        Route("/v1/responses/{response_id}", endpoint(responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", endpoint(responses.delete), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", endpoint(responses.input_items),
              methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", endpoint(responses.cancel),
              methods=["POST"]),
    ]


def messages_routes(messages: MessagesServing, tm: TokenizerManager) -> list[Route]:
    """Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic-shaped
    errors: ``messages_endpoint``)."""
    create = route_guard(tm, "/v1/messages", messages.create)
    return [Route("/v1/messages", messages_endpoint(create), methods=["POST"]),
            Route("/v1/messages/count_tokens", messages_endpoint(messages.count_tokens),
                  methods=["POST"])]


def pooling_routes(pooling: PoolingServing) -> list[Route]:
    """``/v1/embeddings``, ``/v1/rerank`` (also ``/rerank``) and ``/v1/score``."""
    rerank = endpoint(pooling.rerank)
    return [Route("/v1/embeddings", endpoint(pooling.embeddings), methods=["POST"]),
            Route("/v1/rerank", rerank, methods=["POST"]),
            Route("/rerank", rerank, methods=["POST"]),
            Route("/v1/score", endpoint(pooling.score), methods=["POST"])]


def route_table(server: ServerRoutes, responses: ResponsesServing,
                pooling: PoolingServing | None = None,
                messages: MessagesServing | None = None) -> list[Route]:
    """Every route of the app, each handler wrapped by ``endpoint`` (one wrapper per
    handler, shared by its paths; the generation routes' own, which refuse a pooling
    model naming the route; the Messages routes by ``messages_endpoint``)."""
    wrapped: dict[str, Callable] = {}

    def handler_of(path: str, name: str) -> Callable:
        if path in GENERATION_PATHS:
            return endpoint(route_guard(server.tm, path, getattr(server, name)))
        return wrapped.setdefault(name, endpoint(getattr(server, name)))

    routes = [Route(path, handler_of(path, name), methods=methods)
              for path, name, methods in SERVER_ROUTES]
    # after chat completions, as listed before
    routes[2:2] = responses_routes(responses, server.tm) + messages_routes(
        messages or MessagesServing(server.serving), server.tm)
    return [*routes, *pooling_routes(pooling or PoolingServing(server.serving)),
            *openapi_routes(server.model_name, server.facts, wrap=endpoint)]


# ---- error handlers and middleware ---------------------------------------------------------
async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (an unknown route) and 405 (a wrong method), OpenAI-shaped."""
    assert isinstance(exc, HTTPException)
    msg = exc.detail
    if exc.status_code == 404:
        msg = f"Unknown route: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        msg = f"Method {request.method} is not allowed on {request.url.path}"
    headers = dict(exc.headers or {})
    if "Allow" in headers:  # OPTIONS is answered on every route (server/http/cors.py)
        headers["Allow"] += ", OPTIONS"
    err = APIError(msg, exc.status_code, None, None, headers=headers)
    return error_response(err) if is_messages_path(request.url.path) else err.response()


async def server_error(request: Request, exc: Exception) -> Response:
    """What escapes every handler: a shaped 500."""
    return http_error(500, "internal server error").response()


#: the app's exception handlers
EXCEPTION_HANDLERS = {HTTPException: http_exception, 500: server_error}


def middleware_of(args) -> list[Middleware]:
    """The middleware, outermost first: request ids, CORS (``--allowed-origins``), the
    answer to ``OPTIONS``, the API key (``--api-key``)."""
    cors = cors_options(args)
    return [Middleware(RequestIdMiddleware),
            *([Middleware(FerryCORSMiddleware, **cors)] if cors else []),
            Middleware(OptionsMiddleware),
            Middleware(AuthMiddleware, api_key=args.api_key)]


def build_app(tm: TokenizerManager, args, children: dict | None = None) -> Starlette:
    """Build the Starlette app.

    Args:
        tm: the started ``TokenizerManager`` (engine ready).
        args: ``ServerArgs``.
        children: ``{"engine": Process, "detokenizer": Process}``; their pids are shown in
            ``/server_info``.
    """
    # an image model takes bodies that hold its allowed images as base64
    args = args.replace(max_request_bytes=request_body_limit(args, tm.images is not None))
    serving = OpenAIServing(tm, args, model_name_of(args))
    responses = ResponsesServing(serving)  # its store lives here, for every replica
    server = ServerRoutes(tm, args, serving, children, responses)
    app = Starlette(routes=route_table(server, responses, PoolingServing(serving),
                                       MessagesServing(serving)),
                    middleware=middleware_of(args),
                    exception_handlers=EXCEPTION_HANDLERS)
    # no 307 to the path without its trailing slash (its Location would be built from the
    # client's Host header): "/v1/completions/" is an unknown route, a shaped 404
    app.router.redirect_slashes = False
    return app
