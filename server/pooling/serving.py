"""The handlers of ``/v1/embeddings``, ``/v1/rerank`` (also ``/rerank``) and ``/v1/score``.

Each prompt becomes one pooling request to the engine (``TokenizedGenerateReq`` with
``pooling``): prefill only, answered with its vector or score (``PooledOut``), so the
prompts of one call batch with each other and with other calls'. A generation model's
server answers these routes with a 400 naming the route, as an embedding server answers the
generation routes (``route_guard``).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.sampling.params import SamplingParams
from engine.tokenizer.score_prompts import score_prompt_ids
from server.http.errors import APIError, bad_request, unavailable
from server.http.request_id import request_id_of
from server.openai.field_limits import check_fields
from server.pipeline.job import check_fan_out
from server.pooling.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from server.tokenizer_manager import TokenizerManager

#: a pooling request's engine settings: its one "token" is the answer
POOL_PARAMS = SamplingParams(max_tokens=1)
#: what each route needs of the engine (``PoolingSpec.task``)
EMBED_TASKS = ("embed",)
SCORE_TASKS = ("classify", "yes_no")


def encode_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


def truncate(values: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first ``dimensions`` values, L2-normalised again when the model normalises
    (Matryoshka embeddings: truncate, then re-normalise)."""
    if dimensions is None or dimensions >= len(values):
        return values
    cut = values[:dimensions]
    if not normalize:
        return cut
    norm = math.sqrt(sum(v * v for v in cut)) or 1.0
    return [v / norm for v in cut]


class PoolingServing:
    """The pooling routes over the ``OpenAIServing`` (body parsing, model check, engine
    client) of the server.

    Args:
        serving: the server's ``OpenAIServing``.
    """

    def __init__(self, serving):
        self.serving = serving
        self.tm: TokenizerManager = serving.tm

    @property
    def spec(self) -> dict:
        """The engine's ``PoolingSpec.describe()`` ({} for a generation model)."""
        ready = self.tm.engine_ready
        return dict(ready.pooling) if ready is not None else {}

    def need(self, tasks: tuple[str, ...], route: str) -> dict:
        """The engine's pooling spec if it serves ``route``; else a 400 naming the route."""
        spec = self.spec
        if spec.get("task") in tasks:
            return spec
        if not spec:
            what = "a generation model"
        elif spec["task"] == "embed":
            what = "an embedding model (it answers /v1/embeddings)"
        else:
            what = "a scoring model (it answers /v1/rerank, /rerank and /v1/score)"
        need = ("an embedding model (--is-embedding, or a checkpoint detected as one)"
                if tasks == EMBED_TASKS else "a *ForSequenceClassification cross-encoder "
                "or a causal reranker with --yes-no-reranker")
        raise bad_request(f"POST {route} is not available: this server serves {what}; the "
                          f"route needs {need}", "model", "route_not_supported")

    def check_body(self, req) -> None:
        """The body's ``model`` (404 for an unknown one; 400 for a LoRA adapter: pooling runs
        on the base model) and ``user`` (OpenAI's bound)."""
        if self.serving.check_model(req.model) is not None:
            raise bad_request("LoRA adapters are not served on the pooling routes: name the "
                              "base model", "model")
        check_fields({"user": req.user})

    async def run(self, base: str, prompts: list[list[int]], param: str) -> list[list[float]]:
        """Send one pooling request per prompt and return their answers in order.

        Raises:
            APIError: 400 for a prompt outside the vocabulary or the context (naming
                ``param``), too many prompts for the server, 503 (queue full, engine gone,
                shutting down), 500 when the engine failed a request.
        """
        check_fan_out(self.tm, len(prompts), 1)
        for i, ids in enumerate(prompts):
            self.tm.check_prompt(ids, 1, param if len(prompts) == 1 else f"{param}[{i}]")
        reqs = [(f"{base}-{i}", ids, POOL_PARAMS) for i, ids in enumerate(prompts)]
        answers: list[list[float] | None] = [None] * len(prompts)
        async for out in self.tm.generate(reqs, stream=False, arrival=time.monotonic(),
                                          pooling=True):
            if out.pooled is None:  # aborted: the server stopping, or the engine failed it
                message = (out.finish_reason or {}).get("message") or "aborted"
                if self.tm.shutting_down or self.tm.dead is not None:
                    raise unavailable(f"the request was not finished: {message}")
                raise APIError(f"the engine did not finish the request: {message}", 500)
            answers[out.index] = out.pooled
        return answers

    # ---- /v1/embeddings ------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: OpenAI's ``{"object": "list", "data": [{"object":
        "embedding", "index", "embedding"}], "model", "usage"}``.

        Raises:
            APIError: 400 for a bad body, ``dimensions`` on a model without Matryoshka
                support or above its width, a scoring or generation model; 503.
        """
        spec = self.need(EMBED_TASKS, "/v1/embeddings")
        base = request_id_of(request, "embd")
        req: EmbeddingRequest = await self.serving.parse(EmbeddingRequest, request)
        self.check_body(req)
        if req.dimensions is not None:
            self._check_dimensions(spec, req.dimensions)
        prompts = []
        for p in req.prompts():
            if isinstance(p, str):
                self.tm.chat.need_tokenizer("input")
                prompts.append(await self.tm.chat.tokenize(p))
            else:
                prompts.append(list(p))
        vectors = await self.run(base, prompts, "input")
        n_tokens = sum(len(p) for p in prompts)
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(
            truncate(v, req.dimensions, spec.get("normalize", True)), req.encoding_format)}
            for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": self.serving.model_name,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})

    def _check_dimensions(self, spec: dict, dimensions: int) -> None:
        if not spec.get("matryoshka"):
            raise bad_request("dimensions: this model does not support Matryoshka "
                              "truncation (serve it with --enable-matryoshka if it was "
                              "trained for it, or set is_matryoshka in its config.json)",
                              "dimensions")
        allowed = spec.get("matryoshka_dims") or []
        if allowed and dimensions not in allowed:
            raise bad_request(f"dimensions: {dimensions} is not one of the model's "
                              f"Matryoshka dimensions {allowed}", "dimensions")
        width = self.tm.engine_ready.pooling.get("hidden_size")
        if width and dimensions > width:
            raise bad_request(f"dimensions: {dimensions} is above the model's {width}",
                              "dimensions")

    # ---- scores --------------------------------------------------------------------------
    async def _scores(self, base: str, spec: dict, pairs: list[tuple[str, str]],
                      instruction: str | None, param: str) -> tuple[list[float], int]:
        """The score of each (query, document) pair, and the prompt tokens they took."""
        tok = self.tm.chat.need_tokenizer(param)

        def build():
            return [score_prompt_ids(tok, spec["task"], a, b, instruction) for a, b in pairs]

        prompts = await asyncio.to_thread(build)
        answers = await self.run(base, prompts, param)
        return [a[0] for a in answers], sum(len(p) for p in prompts)

    async def rerank(self, request: Request) -> Response:
        """``POST /v1/rerank`` (and ``/rerank``): ``{"id", "model", "usage": {"total_tokens"},
        "results": [{"index", "relevance_score", "document": {"text"}}]}``, best first,
        ``top_n`` of them (all by default).

        Raises:
            APIError: 400 for a bad body or a model that does not score; 503.
        """
        spec = self.need(SCORE_TASKS, request.url.path)
        base = request_id_of(request, "rerank")
        req: RerankRequest = await self.serving.parse(RerankRequest, request)
        self.check_body(req)
        docs = req.texts()
        scores, n_tokens = await self._scores(base, spec, [(req.query, d) for d in docs],
                                              req.instruction, "documents")
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or len(docs)]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})}
                   for i in order]
        return JSONResponse({"id": base, "model": self.serving.model_name,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
                             "results": results})

    async def score(self, request: Request) -> Response:
        """``POST /v1/score``: vLLM's ``{"id", "object": "list", "created", "model", "data":
        [{"index", "object": "score", "score"}], "usage"}``, in pair order.

        Raises:
            APIError: 400 for a bad body, lists of unequal lengths, a model that does not
                score; 503.
        """
        spec = self.need(SCORE_TASKS, "/v1/score")
        base = request_id_of(request, "score")
        req: ScoreRequest = await self.serving.parse(ScoreRequest, request)
        self.check_body(req)
        try:
            pairs = req.pairs()
        except ValueError as e:
            raise bad_request(str(e), "text_1") from None
        scores, n_tokens = await self._scores(base, spec, pairs, req.instruction, "text_2")
        return JSONResponse({
            "id": base, "object": "list", "created": int(time.time()),
            "model": self.serving.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


#: the generation routes a pooling server refuses (``route_guard``)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses",
                    "/invocations")


def route_guard(tm: TokenizerManager, path: str, handler):
    """``handler`` of generation route ``path``, answering a 400 that names the route while
    the engine serves a pooling model."""

    async def guarded(request: Request) -> Response:
        ready = tm.engine_ready
        pooling = ready.pooling if ready is not None else {}
        if pooling:
            other = ("/v1/embeddings" if pooling.get("task") == "embed"
                     else "/v1/rerank, /rerank and /v1/score")
            raise bad_request(f"POST {path} is not available: this server serves a pooling "
                              f"model, which generates no text; it answers {other}",
                              "model", "route_not_supported")
        return await handler(request)

    return guarded
