"""OpenAI's Responses API: ``POST /v1/responses``, on top of the chat machinery.

A request is validated here (``ResponsesRequest``; every field is implemented, an accepted
no-op or a 400 naming it), turned into a ``/v1/chat/completions`` body (``to_chat``:
``instructions`` + ``input`` -> ``messages``, ``max_output_tokens`` -> ``max_completion_tokens``,
``text.format`` -> ``response_format``, flat function ``tools``/``tool_choice`` -> the chat
shapes) and then runs exactly as a chat request: the same template, the same sampling, the
same structured-output and tool-calling code (``server/tools/structured.py``,
``server/tools/plan.py``). The answer is written by ``server/responses/events.py`` from the
chat format's chunks: a ``response`` object, or typed SSE events.

ferry is stateless: ``previous_response_id``, ``conversation`` and ``background: true`` are
400s naming the field. ``store`` is accepted either way (``true`` is OpenAI's default, and
sglang-router writes it into every body it forwards): nothing is stored, and the response
says ``"store": false``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.errors import APIError, bad_request, not_supported
from server.http.request_id import request_id_of
from server.openai import extensions
from server.openai.formats import LogprobOptions
from server.openai.protocol import (
    ENGINE_DERIVED,
    INT32_MAX,
    SAMPLING_FIELDS,
    ChatCompletionRequest,
    _Base,
    from_validation_error,
    parse_request,
)
from server.openai.serving import (
    ClientGone,
    OpenAIServing,
    _SSEResponse,
    read_json,
    run_until_disconnect,
)
from server.openai.tokens import chat_prompt
from server.openai.tool_format import chat_format
from server.responses.events import ResponseBuilder, sse_event
from server.responses.input import (
    ChatConversion,
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
)
from server.tools.plan import prepare_chat

logger = logging.getLogger("ferry.server")

#: fields accepted and ignored: bookkeeping on OpenAI's side or hints that change no output
RESPONSES_NOOPS = frozenset({"metadata", "user", "safety_identifier", "prompt_cache_key",
                             "prompt_cache_retention", "service_tier", "reasoning"})
#: the no-ops whose type OpenAI checks (and ferry echoes in the response)
NOOP_TYPES = {"metadata": dict, "user": str, "safety_identifier": str, "prompt_cache_key": str}
#: ferry's sampling extensions passed to the engine under their own names (as on chat)
SAMPLING_PASSTHROUGH = frozenset(SAMPLING_FIELDS) - ENGINE_DERIVED - {"max_tokens", "temperature",
                                                                        "top_p"}
#: ``include`` values with nothing to include: the items they name never appear here
NOOP_INCLUDES = frozenset({"file_search_call.results", "web_search_call.results",
                           "web_search_call.action.sources", "message.input_image.image_url",
                           "computer_call_output.output.image_url",
                           "code_interpreter_call.outputs", "reasoning.encrypted_content"})
#: stateful or hosted features ferry has not got: a 400 naming them when set
STATEFUL = {"previous_response_id": "responses are not stored (ferry is stateless); send "
                                    "the whole conversation in 'input'",
            "conversation": "conversations are not stored (ferry is stateless)",
            "prompt": "stored prompt templates", "context_management": "context management",
            "moderation": "moderation", "access_programs": "programmatic tool calling",
            "background_options": "background responses", "image": "image generation",
            "prompt_cache_options": "prompt cache options"}


class ResponsesRequest(_Base):
    """``POST /v1/responses``. Undeclared fields: ``RESPONSES_NOOPS``, ``STATEFUL`` (400),
    ferry's sampling extensions (``SAMPLING_PASSTHROUGH``), anything else a 400."""

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: dict | None = None
    text: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)

    def check(self) -> None:
        """Raises: APIError 400 naming the first field ferry cannot honour."""
        for name, value in (self.model_extra or {}).items():
            want = NOOP_TYPES.get(name)
            if want is not None and value is not None and not isinstance(value, want):
                kind = "an object" if want is dict else "a string"
                raise APIError(f"'{name}' must be {kind}", 400, name, "invalid_type")
            if name in RESPONSES_NOOPS or name in SAMPLING_PASSTHROUGH:
                continue
            if name in STATEFUL:
                raise not_supported(name, STATEFUL[name])
            if name in extensions.EXTENSION_FIELDS:  # SGLang's and vLLM's, at their defaults
                err = extensions.check_extension(name, value)
                if err is not None:
                    raise err
                continue
            if name in ("rid", "request_id"):  # the response's id (extensions.adopt_body_id)
                extensions.body_request_id(self.model_extra)
                continue
            raise APIError(f"unrecognized request field '{name}' (see docs/usage.md for the "
                           "fields /v1/responses accepts)", 400, name, "unrecognized_field")
        if self.background:
            raise not_supported("background", "background responses")
        if self.truncation == "auto":
            raise not_supported("truncation", "only 'disabled' (an input beyond the context "
                                "is a 400)")
        if self.top_logprobs:
            raise not_supported("top_logprobs")
        if self.max_tool_calls is not None:
            raise not_supported("max_tool_calls")
        for i, inc in enumerate(self.include or []):
            if inc == "message.output_text.logprobs":
                raise not_supported(f"include[{i}]", "logprobs")
            if inc not in NOOP_INCLUDES:
                raise bad_request(f"include[{i}]: unknown value {inc!r}", f"include[{i}]")
        if self.stream_options is not None:
            if not self.stream:
                raise bad_request("stream_options is only allowed when stream is true",
                                  "stream_options")
            for key, value in self.stream_options.items():
                if key != "include_obfuscation" or not isinstance(value, bool):
                    raise bad_request(f"stream_options.{key}: only include_obfuscation (a "
                                      "boolean) is accepted", f"stream_options.{key}")


def to_chat(req: ResponsesRequest) -> ChatConversion:
    """The ``/v1/chat/completions`` body of a validated Responses request.

    Raises:
        APIError: 400 naming the Responses field (a malformed item, tool or format).
    """
    msgs, origins = chat_messages(req.instructions, req.input)
    body: dict[str, Any] = {"messages": msgs}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if req.tool_choice is not None and (req.tools or req.tool_choice != "auto"):
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.text is not None:
        rf = chat_response_format(req.text)
        if rf is not None:
            body["response_format"] = rf
    for name, value in (req.model_extra or {}).items():
        if name in SAMPLING_PASSTHROUGH:
            body[name] = value
    return ChatConversion(body, origins)


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a decoded JSON body. Raises: APIError 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    req.check()
    return req


def echo_fields(req: ResponsesRequest) -> dict:
    """The request's settings as the ``response`` object repeats them."""
    text = dict(req.text or {})
    text.setdefault("format", {"type": "text"})
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "text": text,
            "tool_choice": choice, "tools": list(req.tools or []),
            "metadata": (req.model_extra or {}).get("metadata") or {},
            "user": (req.model_extra or {}).get("user")}


class ResponsesServing:
    """The ``/v1/responses`` handler, sharing ``OpenAIServing``'s engine and checks."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, request: Request) -> Response:
        """``POST /v1/responses``: a ``response`` object, or its SSE events with
        ``stream: true``.

        Raises:
            APIError: 400 naming the field, 404 for an unknown model, 503 when the server
                cannot take it, the engine's error for a rejected request.
        """
        s, tm, args = self.serving, self.serving.tm, self.serving.args
        t0 = time.monotonic()
        rid = request_id_of(request, "resp")  # X-Request-Id, else a new id
        req = parse_responses_request(await read_json(request, args.max_request_bytes,
                                                      args.body_read_timeout))
        rid = extensions.adopt_body_id(request, req.model_extra, rid)
        s.check_model(req.model)
        conv = to_chat(req)
        try:
            chat: ChatCompletionRequest = parse_request(ChatCompletionRequest, conv.body,
                                                        max_n=1)
            sp = s._params(chat, req.max_output_tokens)
            tools, sp = await prepare_chat(chat, sp, getattr(tm.tokenizer, "chat_template",
                                                             None), tm.tool_call_parser)
            ids = await chat_prompt(tm, chat, tools)
            tm.check_prompt(ids, sp.max_tokens, "input", min_tokens=sp.min_tokens,
                            max_tokens_param="max_output_tokens"
                            if req.max_output_tokens is not None else None)
        except APIError as err:
            raise conv.rename(err) from None
        lp = LogprobOptions(skip_special_tokens=sp.skip_special_tokens,
                            spaces_between_special_tokens=sp.spaces_between_special_tokens)
        fmt = chat_format(tools, rid, s.model_name, 1, len(ids), False, False, s.strings, lp,
                          n=1)
        build = ResponseBuilder(rid, s.model_name, fmt, echo_fields(req))
        s._log_request(fmt, conv.body["messages"], sp)
        rids: list[str] = []  # the engine rid generate registers (unique; see request_id)
        gen = tm.generate([(rid, ids, sp)], req.stream, arrival=t0, registered=rids)
        if not req.stream:
            async def collect() -> None:
                async for o in gen:
                    build.feed(o)

            try:
                await run_until_disconnect(request, collect())
            except ClientGone:
                return Response(status_code=499)
            s._log_output(fmt)
            return JSONResponse(build.response())

        async def first():
            return await anext(gen)

        try:
            head = await run_until_disconnect(request, first())
        except ClientGone:
            return Response(status_code=499)

        async def events():
            for e in build.start():
                yield sse_event(e)
            try:
                item = head
                while item is not None:
                    for e in build.feed(item):
                        yield sse_event(e)
                    item = await anext(gen, None)
            except APIError as err:
                for e in build.fail(err):
                    yield sse_event(e)
            except Exception:  # noqa: BLE001 - logged; the client gets a failed response
                logger.exception("responses stream failed")
                for e in build.fail(APIError("internal error while streaming", 500)):
                    yield sse_event(e)
            s._log_output(fmt)

        return _SSEResponse(events(), on_close=lambda: tm.abort(rids))
