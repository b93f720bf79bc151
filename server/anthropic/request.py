"""The body of ``POST /v1/messages`` (and of ``/v1/messages/count_tokens``), and its chat form.

``MessagesRequest`` validates it; ``check`` goes through the fields the model does not
declare: accepted no-ops (``MESSAGES_NOOPS``), features ferry has not got (``NOT_SUPPORTED``,
a 400 naming them unless empty), ferry's sampling extensions (``seed``, ``min_tokens``...,
as on chat) and anything else, a 400 naming it. ``to_chat`` turns it into a
``/v1/chat/completions`` body (``server/anthropic/blocks.py`` converts the blocks):

- ``max_tokens`` -> ``max_completion_tokens``; ``stop_sequences`` -> ``stop``;
  ``temperature``, ``top_p``, ``top_k`` as they are;
- ``output_config.format`` (``{"type": "json_schema", "schema"}``) -> ``response_format``;
  ``output_config.effort`` is a no-op;
- a last message from the ``assistant`` (a prefill) -> ``continue_final_message: true``
  (and ``add_generation_prompt: false``): the model continues that text, and the answer's
  content is the continuation only, as Anthropic's;
- ``thinking`` -> the chat template's switch ``chat_template_kwargs.enable_thinking``
  (``enabled``/``adaptive``: true, ``disabled``: false; absent: the template's default).
  With ``--reasoning-parser`` what the model thinks comes back as ``thinking`` blocks (the
  parser reads the same switch and the rendered prompt); without one, as ``text``.

No-ops (``MESSAGES_NOOPS``): ``metadata`` (its ``user_id`` bounded to
``MAX_USER_ID_LEN`` characters), ``service_tier``, ``cache_control`` (prompt caching is
automatic: the radix cache reuses every prompt prefix it holds), ``context_management``
(nothing is cleared: a conversation beyond the context is a 400), ``inference_geo``,
``speed``, ``diagnostics``, ``user_profile_id``, ``workspace_id``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from server.anthropic.blocks import Origins, chat_messages, chat_tool_choice, chat_tools
from server.http.errors import APIError, bad_request, not_supported
from server.openai.protocol import (
    ENGINE_DERIVED,
    INT32_MAX,
    MAX_STOP_STRINGS,
    SAMPLING_FIELDS,
    _Base,
    from_validation_error,
)
from server.openai.protocol_base import MAX_MESSAGES

#: most characters of ``metadata.user_id``
MAX_USER_ID_LEN = 512
#: fields accepted and ignored (see the module docstring)
MESSAGES_NOOPS = frozenset({"metadata", "service_tier", "cache_control", "context_management",
                            "inference_geo", "speed", "diagnostics", "user_profile_id",
                            "workspace_id"})
#: hosted features ferry has not got: a 400 naming them unless null or empty
NOT_SUPPORTED = {"container": "code execution containers",
                 "mcp_servers": "remote MCP servers (run the tools on the client)"}
#: ferry's sampling extensions (as on chat): passed to the chat request as they are
SAMPLING_PASSTHROUGH = frozenset(SAMPLING_FIELDS) - ENGINE_DERIVED - {
    "max_tokens", "temperature", "top_p", "top_k", "stop"}
#: ``thinking`` types and the template switch each sets
THINKING = {"enabled": True, "adaptive": True, "disabled": False}
#: Anthropic's smallest thinking budget
MIN_THINKING_BUDGET = 1024


class MessagesRequest(_Base):
    """``POST /v1/messages``. Undeclared fields: see ``check``."""

    model: str
    messages: list[Any] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[Any] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    def check(self) -> None:
        """Raises: APIError 400 naming the first field ferry cannot take (see the module
        docstring)."""
        for name, value in (self.model_extra or {}).items():
            if name in MESSAGES_NOOPS or name in SAMPLING_PASSTHROUGH:
                continue
            if name in NOT_SUPPORTED:
                if value not in ([], {}, ""):
                    raise not_supported(name, NOT_SUPPORTED[name])
                continue
            raise APIError(f"{name}: Extra inputs are not permitted (see docs/usage.md for "
                           "the fields /v1/messages accepts)", 400, name, "unrecognized_field")
        metadata = (self.model_extra or {}).get("metadata")
        if metadata is not None:
            _check_metadata(metadata)
        if self.thinking is not None:
            thinking_switch(self.thinking, self.max_tokens)
        if self.output_config is not None:
            output_format(self.output_config)


class CountTokensRequest(_Base):
    """``POST /v1/messages/count_tokens``'s body as ``/openapi.json`` states it:
    ``/v1/messages``' without ``max_tokens``, ``stream``, ``stop_sequences``, the sampling
    fields, ``metadata`` and ``service_tier`` (``parse_messages_request(count_only=True)``
    validates it)."""

    model: str
    messages: list[Any] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None


def _check_metadata(metadata: Any) -> None:
    if not isinstance(metadata, dict):
        raise bad_request("metadata: expected an object", "metadata")
    for key, value in metadata.items():
        if key != "user_id":
            raise bad_request(f"metadata.{key}: Extra inputs are not permitted",
                              f"metadata.{key}")
        if value is not None and not isinstance(value, str):
            raise bad_request("metadata.user_id: expected a string", "metadata.user_id")
        if value is not None and len(value) > MAX_USER_ID_LEN:
            raise bad_request(f"metadata.user_id: String should have at most "
                              f"{MAX_USER_ID_LEN} characters", "metadata.user_id")


def thinking_switch(thinking: dict, max_tokens: int) -> bool:
    """The chat template's ``enable_thinking`` of a ``thinking`` setting (which the
    reasoning parser also reads: off, the output is all text).

    Raises: APIError 400 naming the field (an unknown type, a budget below 1024 or not
    below ``max_tokens``, as Anthropic checks it)."""
    kind = thinking.get("type")
    if kind not in THINKING:
        raise bad_request("thinking.type: expected 'enabled', 'adaptive' or 'disabled'",
                          "thinking.type")
    allowed = {"type", "budget_tokens", "display"} if kind != "disabled" else {"type"}
    for key in thinking:
        if key not in allowed:
            raise bad_request(f"thinking.{key}: Extra inputs are not permitted",
                              f"thinking.{key}")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise bad_request("thinking.budget_tokens: Field required (an integer)",
                              "thinking.budget_tokens")
        if budget < MIN_THINKING_BUDGET:
            raise bad_request(f"thinking.budget_tokens: Input should be greater than or "
                              f"equal to {MIN_THINKING_BUDGET}", "thinking.budget_tokens")
        if budget >= max_tokens:
            raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`",
                              "thinking.budget_tokens")
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise bad_request("thinking.display: expected 'summarized' or 'omitted'",
                          "thinking.display")
    return THINKING[kind]


def output_format(config: dict) -> dict | None:
    """Chat's ``response_format`` of ``output_config`` (None: free text).

    Raises: APIError 400 naming the field."""
    for key in config:
        if key not in ("effort", "format"):
            raise bad_request(f"output_config.{key}: Extra inputs are not permitted",
                              f"output_config.{key}")
    if config.get("effort") not in (None, "low", "medium", "high", "xhigh", "max"):
        raise bad_request("output_config.effort: expected 'low', 'medium', 'high', 'xhigh' "
                          "or 'max'", "output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict) or set(fmt) - {"type", "schema"}:
        raise bad_request("output_config.format: expected {'type': 'json_schema', 'schema': "
                          "{...}}", "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_chat(req: MessagesRequest, *, count_only: bool = False) -> tuple[dict, Origins]:
    """The ``/v1/chat/completions`` body of a validated Messages request, and the origins of
    its messages (for renaming the chat side's errors). ``count_only``: no token budget
    (``/v1/messages/count_tokens``).

    Raises: APIError 400 naming the Messages field (a malformed block, tool or choice)."""
    msgs, origins = chat_messages(req.system, req.messages)
    body: dict[str, Any] = {"messages": msgs}
    if msgs[-1]["role"] == "assistant":  # a prefill: continue it
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    if not count_only:
        body["max_completion_tokens"] = req.max_tokens
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if req.tool_choice is not None:
        choice, parallel = chat_tool_choice(req.tool_choice)
        if req.tools or choice not in ("auto", "none"):
            body["tool_choice"] = choice
        if parallel is not None and req.tools:
            body["parallel_tool_calls"] = parallel
    if req.thinking is not None:
        body["chat_template_kwargs"] = {
            "enable_thinking": thinking_switch(req.thinking, req.max_tokens)}
    if req.output_config is not None:
        rf = output_format(req.output_config)
        if rf is not None:
            body["response_format"] = rf
    for name, value in (req.model_extra or {}).items():
        if name in SAMPLING_PASSTHROUGH:
            body[name] = value
    return body, origins


def parse_messages_request(body: Any, *, count_only: bool = False) -> MessagesRequest:
    """Validate a decoded JSON body (``count_only``: ``/v1/messages/count_tokens``, whose
    body has no ``max_tokens``, ``stream`` or sampling fields).

    Raises: APIError 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if count_only:
        for name in ("max_tokens", "stream", "stop_sequences", "temperature", "top_p",
                     "top_k", "metadata", "service_tier"):
            if name in body:
                raise bad_request(f"{name}: Extra inputs are not permitted", name)
        body = dict(body, max_tokens=INT32_MAX)
    try:
        req = MessagesRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    req.check()
    return req
