"""The request of OpenAI's Responses API, ``POST /v1/responses``, and its chat form.

``ResponsesRequest`` validates it: every field is implemented, an accepted no-op
(``RESPONSES_NOOPS``) or a 400 naming it (``STATEFUL``: features ferry has not got).
``to_chat`` turns it into a ``/v1/chat/completions`` body (``instructions`` + ``input`` ->
``messages``, ``max_output_tokens`` -> ``max_completion_tokens``, ``text.format`` ->
``response_format``, flat function ``tools``/``tool_choice`` -> the chat shapes,
``reasoning.effort`` (one of OpenAI's values) -> ``chat_template_kwargs.reasoning_effort``
(``reasoning`` is in ``RESPONSES_NOOPS`` for the rest of it: ``reasoning.summary`` is checked
and echoed, a no-op); the item
conversions are ``server/responses/input.py``); ``echo_fields`` are the settings the
``response`` object repeats. The handler is ``server/responses/serving.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from server.http.errors import APIError, bad_request, not_supported
from server.openai import extensions, field_limits
from server.openai.chat_checks import check_reasoning_effort
from server.openai.protocol import (
    ENGINE_DERIVED,
    INT32_MAX,
    SAMPLING_FIELDS,
    _Base,
    from_validation_error,
)
from server.responses.input import (
    ChatConversion,
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
)

#: fields accepted and ignored: bookkeeping on OpenAI's side or hints that change no output
RESPONSES_NOOPS = frozenset({"metadata", "user", "safety_identifier", "prompt_cache_key",
                             "prompt_cache_retention", "service_tier", "reasoning"})
#: ferry's sampling extensions passed to the engine under their own names (as on chat)
SAMPLING_PASSTHROUGH = frozenset(SAMPLING_FIELDS) - ENGINE_DERIVED - {"max_tokens", "temperature",
                                                                        "top_p"}
#: ``reasoning.summary`` values (echoed as sent, a no-op)
REASONING_SUMMARIES = ("auto", "concise", "detailed")
#: ``include`` values with nothing to include: the items they name never appear here
NOOP_INCLUDES = frozenset({"file_search_call.results", "web_search_call.results",
                           "web_search_call.action.sources", "message.input_image.image_url",
                           "computer_call_output.output.image_url",
                           "code_interpreter_call.outputs", "reasoning.encrypted_content"})
#: stateful or hosted features ferry has not got: a 400 naming them when set
STATEFUL = {"conversation": "the Conversations API (continue a stored response with "
                            "'previous_response_id')",
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
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)

    def check(self) -> None:
        """Raises: APIError 400 naming the first field ferry cannot honour, or a bounded
        no-op (``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``) beyond
        OpenAI's bounds (``server/openai/field_limits.py``)."""
        for name, value in (self.model_extra or {}).items():
            err = field_limits.check_field(name, value)  # metadata, user... (OpenAI's bounds)
            if err is not None:
                raise err
            if name in RESPONSES_NOOPS or name in SAMPLING_PASSTHROUGH:
                continue
            if name in STATEFUL:
                raise not_supported(name, STATEFUL[name])
            if name in extensions.EXTENSION_FIELDS:  # SGLang's and vLLM's, at their defaults
                err = extensions.check_extension(name, value)
                if err is not None:
                    raise err
                continue
            if name in extensions.ROUTE_FIELDS:  # lora_path: the route reads it (lora_choice)
                continue
            if name in extensions.IMPLEMENTED:  # chat and completions fields
                err = extensions.chat_only_error(name, value)
                if err is not None:
                    raise err
                continue
            if name in ("rid", "request_id"):  # the response's id (extensions.adopt_body_id)
                extensions.body_request_id(self.model_extra)
                continue
            raise APIError(f"unrecognized request field '{name}' (see docs/usage.md for the "
                           "fields /v1/responses accepts)", 400, name, "unrecognized_field")
        reasoning_effort(self), reasoning_summary(self)  # OpenAI's values, else a 400
        if self.background and self.store is False:
            raise bad_request("background responses need store: true (they are read back "
                              "with GET /v1/responses/{id})", "background")
        if self.background and self.stream:
            raise not_supported("background", "background responses with stream: true (poll "
                                "GET /v1/responses/{id} instead)")
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


def to_chat(req: ResponsesRequest, prior: list[dict] = ()) -> ChatConversion:
    """The ``/v1/chat/completions`` body of a validated Responses request, continuing the
    ``prior`` items (the stored conversation of ``previous_response_id``).

    Raises:
        APIError: 400 naming the Responses field (a malformed item, tool or format).
    """
    msgs, origins = chat_messages(req.instructions, req.input, prior)
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
    effort = reasoning_effort(req)
    if effort is not None:  # for the templates that take it (gpt-oss's); others ignore it
        body["chat_template_kwargs"] = {"reasoning_effort": effort}
    return ChatConversion(body, origins)


def reasoning_effort(req: ResponsesRequest) -> str | None:
    """``reasoning.effort`` of a Responses request (one of OpenAI's ``REASONING_EFFORTS``),
    or None.

    Raises: APIError 400 naming ``reasoning.effort`` for any other value."""
    reasoning = (req.model_extra or {}).get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return check_reasoning_effort(effort, "reasoning.effort")


def reasoning_summary(req: ResponsesRequest) -> str | None:
    """``reasoning.summary`` as sent (a documented no-op: the ``reasoning`` item carries the
    reasoning text, no summary), or None.

    Raises: APIError 400 naming ``reasoning.summary`` unless ``auto``, ``concise`` or
    ``detailed``."""
    reasoning = (req.model_extra or {}).get("reasoning")
    summary = reasoning.get("summary") if isinstance(reasoning, dict) else None
    if summary is not None and summary not in REASONING_SUMMARIES:
        raise bad_request(f"reasoning.summary must be one of "
                          f"{', '.join(map(repr, REASONING_SUMMARIES))} (got {summary!r})",
                          "reasoning.summary")
    return summary


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
            "user": (req.model_extra or {}).get("user"),
            "previous_response_id": req.previous_response_id,
            "background": bool(req.background),
            "reasoning": {"effort": reasoning_effort(req), "summary": reasoning_summary(req)}}
