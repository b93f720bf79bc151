"""OpenAI's Responses API: ``POST /v1/responses``, on top of the chat machinery.

A request is validated (``ResponsesRequest``; every field is implemented, an accepted
no-op or a 400 naming it), turned into a ``/v1/chat/completions`` body (``to_chat``:
``instructions`` + ``input`` -> ``messages``, ``max_output_tokens`` -> ``max_completion_tokens``,
``text.format`` -> ``response_format``, flat function ``tools``/``tool_choice`` -> the chat
shapes), both in ``server/responses/request.py``, and then runs the chat pipeline
(``server/pipeline/``) exactly as a chat request: the same template, the same sampling, the
same structured-output and tool-calling code (``server/tools/structured.py``,
``server/tools/plan.py``). The answer is written by ``server/responses/events.py``'s
``ResponseWriter`` from the chat format's chunks: a ``response`` object, or typed SSE events.

State (``server/responses/store.py``): ``store`` (default true, as OpenAI) keeps the response
in the HTTP process's bounded in-memory store; ``previous_response_id`` continues a stored
one (its conversation, input and output items, goes before this ``input``; its
``instructions`` do not carry over, as OpenAI documents); ``GET``/``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` read and remove them.
``background: true`` (needs ``store``; not with ``stream``) answers at once with status
``queued`` and generates in a task of the HTTP process; ``GET`` polls it and
``POST /v1/responses/{id}/cancel`` cancels it (status ``cancelled``). ``conversation`` (the
Conversations API) is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.body import read_json
from server.http.errors import APIError, bad_request, not_supported
from server.http.request_id import request_id_of
from server.openai import extensions
from server.openai.formats import LogprobOptions
from server.openai.lora_choice import fields_of
from server.openai.protocol import ChatCompletionRequest, parse_request
from server.openai.serving import OpenAIServing
from server.openai.tool_format import chat_format
from server.pipeline.answer import answer, generate, log_request
from server.pipeline.job import ChatJob, prepare
from server.responses.events import ResponseBuilder, ResponseWriter
from server.responses.input import stored_items
from server.responses.request import (
    NOOP_INCLUDES,
    echo_fields,
    parse_responses_request,
    to_chat,
)
from server.responses.store import ResponseStore, StoredResponse, new_response_id

logger = logging.getLogger("ferry.server")

#: ``GET /v1/responses/{id}/input_items``: most items per page, and the default
MAX_ITEMS_PAGE, ITEMS_PAGE = 100, 20


def _query(request: Request, allowed: set[str]) -> dict[str, str]:
    """The query parameters of a stored-response route.

    Raises: APIError 400 naming a parameter the route does not take, or one given twice."""
    out: dict[str, str] = {}
    for key, value in request.query_params.multi_items():
        name = key[:-2] if key.endswith("[]") else key
        if name not in allowed:
            raise bad_request(f"unrecognized query parameter '{key}'", key)
        if name in out and name != "include":
            raise bad_request(f"query parameter '{key}' given twice", key)
        out[name] = value
    if out.get("stream", "false") not in ("false", "0"):
        raise not_supported("stream", "streaming a stored response (GET it without stream)")
    if "include" in out:
        for value in request.query_params.getlist("include") + \
                request.query_params.getlist("include[]"):
            if value not in NOOP_INCLUDES:
                raise bad_request(f"include: unknown or unsupported value {value!r}", "include")
    return out


def items_page(items: list[dict], q: dict[str, str]) -> dict:
    """One page of ``items`` as OpenAI lists them: ``order`` (``desc`` by default), ``limit``
    (1 to 100, default 20), ``after``/``before`` (item ids, exclusive).

    Raises: APIError 400 naming the parameter (a bad value, an unknown item id)."""
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    raw = q.get("limit", str(ITEMS_PAGE))
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_ITEMS_PAGE:
        raise bad_request(f"limit must be an integer in [1, {MAX_ITEMS_PAGE}]", "limit")
    seq = items if order == "asc" else items[::-1]
    ids = [it["id"] for it in seq]
    lo, hi = 0, len(seq)
    for name in ("after", "before"):
        if name in q:
            if q[name] not in ids:
                raise bad_request(f"{name}: no input item '{q[name]}' in this response", name)
            if name == "after":
                lo = ids.index(q[name]) + 1
            else:
                hi = ids.index(q[name])
    page = seq[lo:hi][:int(raw)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": lo + len(page) < hi}


class ResponsesServing:
    """The ``/v1/responses`` handler, sharing ``OpenAIServing``'s engine and checks."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore | None = None):
        self.serving = serving
        args = serving.args
        self.store = store if store is not None else ResponseStore.from_args(args)

    def _keep(self, st: StoredResponse, build: ResponseBuilder, prior: list[dict]) -> None:
        """Store (or update) a finished response with its conversation."""
        st.response, st.live = build.response(), None
        st.conversation = [*prior, *st.input_items, *copy.deepcopy(st.response["output"])]
        if not (self.store.update(st) if st.task is not None else self.store.put(st)):
            build.echo["store"] = False  # bigger than --responses-store-bytes: not stored

    # ---- the stored responses -----------------------------------------------------------
    async def retrieve(self, request: Request) -> Response:
        """``GET /v1/responses/{id}``. Raises: APIError 404 naming an unknown id, 400 for a
        query parameter it does not take (``stream=true``)."""
        _query(request, {"include", "stream", "starting_after", "include_obfuscation"})
        return JSONResponse(self.store.snapshot(request.path_params["response_id"]))

    async def delete(self, request: Request) -> Response:
        """``DELETE /v1/responses/{id}`` (a running background response is cancelled).
        Raises: APIError 404 naming an unknown id."""
        _query(request, set())
        rid = request.path_params["response_id"]
        self.store.delete(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        """``GET /v1/responses/{id}/input_items``: the response's own input items (not those
        of the responses it continues). Raises: APIError 404, 400 naming a bad parameter."""
        q = _query(request, {"after", "before", "limit", "order", "include"})
        st = self.store.get(request.path_params["response_id"])
        return JSONResponse(items_page(copy.deepcopy(st.input_items), q))

    async def cancel(self, request: Request) -> Response:
        """``POST /v1/responses/{id}/cancel``: stop a background response (its engine
        request is aborted; status ``cancelled``); one that has ended is answered as it is.
        Raises: APIError 404 naming an unknown id, 400 for a response not in background."""
        _query(request, set())
        rid = request.path_params["response_id"]
        st = self.store.get(rid)
        if not st.response.get("background"):
            raise bad_request(f"response '{rid}' was not created with background: true; only "
                              "background responses can be cancelled", "response_id")
        if st.running:
            st.task.cancel()
            await asyncio.wait([st.task])
        return JSONResponse(self.store.snapshot(rid))

    async def create(self, request: Request) -> Response:
        """``POST /v1/responses``: a ``response`` object, or its SSE events with
        ``stream: true``.

        Raises:
            APIError: 400 naming the field, 404 for an unknown model, 503 when the server
                cannot take it, the engine's error for a rejected request.
        """
        s, args = self.serving, self.serving.args
        t0 = time.monotonic()
        resp_id = new_response_id()  # server-made, never the client's (store.py)
        rid = request_id_of(request, "resp", resp_id)  # X-Request-Id, else the response's id
        req = parse_responses_request(await read_json(request, args.max_request_bytes,
                                                      args.body_read_timeout))
        rid = extensions.adopt_body_id(request, req.model_extra, rid)
        lora = s.request_loras(req)[0]  # model, SGLang's lora_path
        prior = self._prior(req)
        conv = to_chat(req, prior)
        job = await self._prepare(req, conv, rid, lora, t0)
        lp = LogprobOptions(skip_special_tokens=job.params.skip_special_tokens,
                            spaces_between_special_tokens=job.params.spaces_between_special_tokens)
        shown = lora or s.model_name  # the adapter, as on /v1/chat/completions
        fmt = chat_format(job.tools, rid, shown, 1, job.prompt_tokens, False, False, s.strings,
                          lp, n=1, **job.format_options)
        keep = req.store is not False and self.store.enabled
        if req.background and not keep:
            raise not_supported("background", "background responses with the response store "
                                "off (--responses-store-size or -bytes 0)")
        build = ResponseBuilder(resp_id, shown, fmt, dict(echo_fields(req), store=keep))
        st = StoredResponse({}, stored_items(req.input), prior) if keep else None
        log_request(args.log_requests, fmt, conv.body["messages"], job.params)
        if req.background:
            return self._background(build, generate(s.tm, job, False, []), st, prior)
        on_done = None if st is None else (lambda: self._keep(st, build, prior))
        return await answer(request, s.tm, job, ResponseWriter(build, on_done), req.stream,
                            log=args.log_requests)

    def _prior(self, req) -> list[dict]:
        """The conversation ``previous_response_id`` continues ([] without one).

        Raises: APIError 400 naming an unknown id (code ``previous_response_not_found``) or
        one still in progress."""
        if req.previous_response_id is None:
            return []
        try:
            prev = self.store.get(req.previous_response_id, "previous_response_id")
        except APIError as err:  # OpenAI answers an unknown one with a 400
            raise APIError(err.message, 400, err.param, "previous_response_not_found") \
                from None
        if prev.running:
            raise bad_request(f"response '{req.previous_response_id}' is still in "
                              "progress; continue it once it has ended",
                              "previous_response_id")
        return prev.conversation

    async def _prepare(self, req, conv, rid: str, lora: str | None, t0: float) -> ChatJob:
        """The chat pipeline's job of the request's chat form ``conv``; its errors name the
        Responses fields (``conv.rename``: ``messages`` -> ``input`` etc.).

        Raises: APIError 400 naming the field, 404 for an unknown model."""
        try:
            chat = parse_request(ChatCompletionRequest, conv.body, max_n=1)
            return await prepare(self.serving.tm, chat, base=rid,
                                 max_tokens=req.max_output_tokens, prompt_param="input",
                                 max_tokens_param="max_output_tokens"
                                 if req.max_output_tokens is not None else None,
                                 lora=lora, lora_fields=fields_of(req, 1), arrival=t0)
        except APIError as err:
            raise conv.rename(err) from None

    def _background(self, build: ResponseBuilder, gen, st: StoredResponse,
                    prior: list[dict]) -> Response:
        """Answer a ``background: true`` request at once (status ``queued``) and generate in a
        task of this process; the stored response follows it (``GET``) until it ends."""
        self.serving.tm.check_admission(1)  # a full queue is still this request's 503
        build.status = "queued"

        async def run() -> None:
            try:
                async for o in gen:
                    if build.status == "queued":
                        build.status = "in_progress"
                    build.feed(o)
            except asyncio.CancelledError:
                build.cancel()  # the generator's finally aborted the engine request
            except APIError as err:
                build.fail(err)
            except Exception:  # noqa: BLE001 - logged; the stored response says failed
                logger.exception("background response %s failed", build.id)
                build.fail(APIError("internal error while generating", 500))
            finally:
                await gen.aclose()
                self._keep(st, build, prior)

        st.live = build.response
        st.response = build.response()
        self.store.put(st, refuse_param="background")
        st.task = asyncio.create_task(run(), name=f"background {build.id}")
        return JSONResponse(st.response)
