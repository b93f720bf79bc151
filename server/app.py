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
``GET /openapi.json`` and ``GET /docs`` (``server/openapi/spec.py``). ``OPTIONS`` on a route
answers 204 (CORS preflights included, ``server/http/cors.py``); every response carries
``X-Request-Id`` (``server/http/request_id.py``). Every handler is wrapped so an unexpected
exception still answers an OpenAI-shaped error (and logs the traceback); unknown routes
(404, a trailing slash included: no redirects) and wrong methods (405) are shaped too.
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
    """Pure ASGI middleware: ``Authorization: Bearer <api_key>`` on everything but OPEN_PATHS.

    Compares with ``secrets.compare_digest``.
    """

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and secrets.compare_digest(
                    token.strip(), self.key)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if (self.key is not None and scope["type"] == "http"
                and scope.get("path") not in OPEN_PATHS and not self._authorized(scope)):
            err = APIError("Invalid or missing API key; send 'Authorization: Bearer <key>'",
                           401, None, "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def refresh_engine_gauges(tm: TokenizerManager, timeout_s: float = 1.0) -> None:
    """Ask the engine for its running/waiting counts now (its answer sets the gauges), so
    ``/metrics`` shows the current values, not those of the last periodic report; the
    last ones stay if the engine does not answer within ``timeout_s`` (a long step)."""
    try:
        async with asyncio.timeout(timeout_s):
            await tm.server_info()
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


def build_app(tm: TokenizerManager, args, children: dict | None = None) -> Starlette:
    """Build the Starlette app.

    Args:
        tm: the started ``TokenizerManager`` (engine ready).
        args: ``ServerArgs``.
        children: ``{"engine": Process, "detokenizer": Process}``; their pids are shown in
            ``/server_info``.
    """
    model_name = model_name_of(args)
    serving = OpenAIServing(tm, args, model_name)
    responses = ResponsesServing(serving)  # its store lives here, for every replica
    created = int(time.time())
    children = children or {}
    # --dp-size: per replica {"engine": Process, "detokenizer": Process}
    replica_children = [{k.split("-")[0]: p for k, p in children.items()
                         if (k.partition("-")[2] or "0") == str(i)}
                        for i in range(len(tm.replicas))]

    def model_card() -> dict:
        ready = tm.engine_ready
        return {"id": model_name, "object": "model", "created": created, "owned_by": "ferry",
                "root": args.model_path or model_name,
                "max_model_len": ready.max_context_len if ready else None}

    @endpoint
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @endpoint
    async def chat(request: Request) -> Response:
        return await serving.chat(request)

    @endpoint
    async def tokenize(request: Request) -> Response:
        return await tokens.tokenize(serving, request)

    @endpoint
    async def detokenize(request: Request) -> Response:
        return await tokens.detokenize(serving, request)

    @endpoint
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]
                             + lora.adapter_cards(tm, model_name, created)})

    @endpoint
    async def model(request: Request) -> Response:
        mid = request.path_params["model_id"]
        if mid in (model_name, args.model_path):
            return JSONResponse(model_card())
        for card in lora.adapter_cards(tm, model_name, created):
            if card["id"] == mid:
                return JSONResponse(card)
        raise APIError(f"The model '{mid}' does not exist", 404, "model", "model_not_found")

    @endpoint
    async def load_lora_adapter(request: Request) -> Response:
        return await lora.change_adapter(serving, request, "load")

    @endpoint
    async def unload_lora_adapter(request: Request) -> Response:
        return await lora.change_adapter(serving, request, "unload")

    @endpoint
    async def health(request: Request) -> Response:
        if tm.dead is not None:
            raise http_error(503, f"unhealthy: {tm.dead}")
        if tm.shutting_down:
            raise http_error(503, "the server is shutting down")
        if len(tm.replicas) == 1:
            return JSONResponse({"status": "ok"})
        # --dp-size: 200 while one replica lives ("degraded" once one died)
        degraded = any(not r.alive for r in tm.replicas)
        return JSONResponse({"status": "degraded" if degraded else "ok",
                             "replicas": replica_status(tm.replicas, replica_children)})

    @endpoint
    async def health_generate(request: Request) -> Response:
        await health(request)  # 503 when the engine is dead or the server stops
        await native.generate_one_token(tm, HEALTH_GENERATE_TIMEOUT_S)
        return JSONResponse({"status": "ok"})

    @endpoint
    async def model_info(request: Request) -> Response:
        return JSONResponse(native.model_info(args, model_name))

    @endpoint
    async def get_load(request: Request) -> Response:
        return JSONResponse(native.load_of(await tm.server_info()))

    # vLLM's small routes (server/openai/vllm_routes.py)
    @endpoint
    async def invocations(request: Request) -> Response:
        return await invoke(serving, request)

    @endpoint
    async def ping(request: Request) -> Response:
        return await health(request)

    @endpoint
    async def version(request: Request) -> Response:
        return JSONResponse({"version": ferry_version()})

    @endpoint
    async def load(request: Request) -> Response:
        return JSONResponse(server_load(serving))

    @endpoint
    async def server_info(request: Request) -> Response:
        info = msgspec.structs.asdict(await tm.server_info())
        info.pop("rid", None)  # the IPC message's id, nothing a client can use
        ready = tm.engine_ready
        info.update(native.model_info(args, model_name), **native.router_facts(args, ready))
        info.update({
            "model": model_name, "device": ready.device, "dtype": ready.dtype,
            "kv_cache_dtype": ready.kv_cache_dtype, "quantization": args.quantization,
            "radix_cache": not args.disable_radix_cache, "schedule_policy": args.schedule_policy,
            "max_context_len": ready.max_context_len, "max_total_tokens":
            ready.max_total_tokens, "max_running_requests": ready.max_running_requests,
            "server_pid": os.getpid(),
            "engine_pid": getattr(children.get("engine"), "pid", None),
            "detokenizer_pid": getattr(children.get("detokenizer"), "pid", None),
            "num_inflight": tm.num_inflight, "shutting_down": tm.shutting_down,
        })
        if len(tm.replicas) > 1:  # the figures above are the replicas' sums
            info.update(dp_size=len(tm.replicas), load_balance_method=args.load_balance_method,
                        replicas=replica_status(tm.replicas, replica_children),
                        max_total_tokens=sum(r.ready["engine"].max_total_tokens
                                             for r in tm.replicas),
                        **replica_pids(replica_children))
        return JSONResponse(info)

    @endpoint
    async def flush_cache(request: Request) -> Response:
        out = await tm.flush_cache()
        if not out.success:
            raise http_error(400, out.message)
        return JSONResponse({"message": out.message})

    @endpoint
    async def metrics(request: Request) -> Response:
        if tm.metrics is None:
            raise http_error(503, "metrics are not ready")
        await refresh_engine_gauges(tm)
        tm.metrics.on_response_store(*responses.store.stats())
        body, content_type = tm.metrics.render()
        if len(tm.replicas) > 1:
            body += replica_metrics(tm.replicas, model_name)
        return Response(body, media_type=content_type)

    async def http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        msg = exc.detail
        if exc.status_code == 404:
            msg = f"Unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}"
        headers = dict(exc.headers or {})
        if "Allow" in headers:  # OPTIONS is answered on every route (server/http/cors.py)
            headers["Allow"] += ", OPTIONS"
        return APIError(msg, exc.status_code, None, None, headers=headers).response()

    async def server_error(request: Request, exc: Exception) -> Response:
        return http_error(500, "internal server error").response()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", endpoint(responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", endpoint(responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", endpoint(responses.delete), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", endpoint(responses.input_items),
              methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", endpoint(responses.cancel),
              methods=["POST"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        # what SGLang's routers and their health checks ask (server/openai/native.py)
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        # vLLM's: SageMaker's entry point and health check, the version, the server load
        Route("/invocations", invocations, methods=["POST"]),
        Route("/ping", ping, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST"]),
        # LoRA adapters at run time: SGLang's paths and vLLM's
        Route("/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        *openapi_routes(model_name, lambda: ServerFacts(
            max_n=args.max_n, api_key=bool(args.api_key),
            models=tuple(m for m in (model_name, args.model_path) if m),
            vocab_size=tm.engine_ready.vocab_size if tm.engine_ready else None),
            wrap=endpoint),
    ]
    cors = cors_options(args)
    middleware = [Middleware(RequestIdMiddleware),
                  *([Middleware(FerryCORSMiddleware, **cors)] if cors else []),
                  Middleware(OptionsMiddleware),
                  Middleware(AuthMiddleware, api_key=args.api_key)]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: http_exception, 500: server_error})
    # no 307 to the path without its trailing slash (its Location would be built from the
    # client's Host header): "/v1/completions/" is an unknown route, a shaped 404
    app.router.redirect_slashes = False
    return app
