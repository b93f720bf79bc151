"""Pydantic models of the response bodies, for ``/openapi.json`` only.

The routes build their bodies as dicts (``server/openai/formats.py``, ``server/app.py``); these
models describe them (``server/openapi/spec.py`` turns them into JSON schemas), and the
schemathesis test (``tests/e2e/test_schemathesis.py``) checks every response against them.
Fields a body may carry or not are optional here; every field named is typed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from server.openai.field_limits import MAX_ID_LEN
from server.openai.field_limits import json_schemas as _limit_schemas
from server.openai.protocol_base import json_schema_of
from server.tools.messages import MAX_TOOL_CALLS
from server.tools.plan import MAX_TOOLS
from server.tools.structured import MAX_CHOICES


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- errors -------------------------------------------------------------------------------

class ErrorDetail(_Out):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    """Every error: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


# ---- shared pieces ------------------------------------------------------------------------

class PromptTokensDetails(_Out):
    cached_tokens: int = Field(ge=0, description="prompt tokens served from the prefix cache")


class Usage(_Out):
    """Token counts of a request (every prompt once, every choice's completion)."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(_Out):
    """vLLM's prompt_logprobs entry of one token."""

    logprob: float
    rank: int | None
    decoded_token: str


#: one entry per prompt token: null (the first) or ``{token id: PromptLogprob}``
PromptLogprobs = list[dict[str, PromptLogprob] | None]
FinishReason = Literal["stop", "length", "abort", "tool_calls"]
MatchedStop = str | int | None


# ---- /v1/completions ----------------------------------------------------------------------

class CompletionLogprobs(_Out):
    """The legacy completions logprobs object (parallel lists, one entry per token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int = Field(ge=0)
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    matched_stop: MatchedStop = Field(None, description="SGLang's: the stop string, stop "
                                      "token id or stop_regex pattern that ended the choice")
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, description="return_token_ids (vLLM's)")
    token_ids: list[int] | None = Field(None, description="return_token_ids (vLLM's): the "
                                        "generated ids (a stream chunk's new ones)")


class CompletionResponse(_Out):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Out):
    """One event of a ``/v1/completions`` stream (``choices`` empty in the usage chunk)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- /v1/chat/completions -----------------------------------------------------------------

class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob] | None


class FunctionCall(_Out):
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


class ToolCall(_Out):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Out):
    index: int = Field(ge=0)
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    matched_stop: MatchedStop = None
    token_ids: list[int] | None = Field(None, description="return_token_ids (vLLM's)")


class ChatCompletionResponse(_Out):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM's, for the one "
                                                   "prompt of every choice")
    prompt_token_ids: list[int] | None = Field(None, description="return_token_ids (vLLM's)")


class FunctionCallDelta(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out):
    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int = Field(ge=0)
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: MatchedStop = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = Field(None, description="return_token_ids (vLLM's): the "
                                        "chunk's new token ids")


class ChatCompletionChunk(_Out):
    """One event of a ``/v1/chat/completions`` stream."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, description="return_token_ids (vLLM's): "
                                               "on the first chunk")


# ---- the other routes ---------------------------------------------------------------------

class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int | None


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int = Field(ge=0)
    max_model_len: int
    token_strs: list[str] | None = Field(None, description="with return_token_strs")


class DetokenizeResponse(_Out):
    prompt: str


class HealthResponse(_Out):
    """``degraded``: with ``--dp-size``, some engine replica died (``replicas`` says which)."""

    status: Literal["ok", "degraded"]
    replicas: list[dict[str, Any]] | None = None


class FlushCacheResponse(_Out):
    message: str


class VersionResponse(_Out):
    """``GET /version`` (vLLM's)."""

    version: str


class ServerLoad(_Out):
    """``GET /load`` (vLLM's): engine requests the server waits on now."""

    server_load: int = Field(ge=0)


class ModelInfo(_Out):
    """SGLang's ``/model_info`` (server/openai/native.py)."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    is_generation: bool


class LoadEntry(_Out):
    """One data-parallel rank's load, in SGLang's ``/get_load`` shape."""

    dp_rank: int
    num_reqs: int = Field(ge=0, description="running plus waiting requests")
    num_waiting_reqs: int = Field(ge=0)
    num_tokens: int = Field(ge=0, description="KV tokens held by requests")


class LoadList(RootModel[list[LoadEntry]]):
    """``/get_load``: one entry per data-parallel rank (one per ferry server)."""


class ServerInfo(_Out):
    """Engine and server figures (more keys than listed may appear)."""

    model: str
    device: str
    dtype: str
    quantization: str | None = Field(None, description="--quantization as given (null: none, "
                                     "or the checkpoint's own scheme)")
    max_context_len: int
    max_total_tokens: int
    swa_total_tokens: int = Field(0, description="slots of the windowed KV pool of the "
                                  "sliding-window layers (--swa-full-tokens-ratio; 0: none, "
                                  "max_total_tokens holds every layer)")
    max_running_requests: int
    chunked_prefill_size: int = Field(description="the effective prefill chunk: most prompt "
                                      "tokens one step prefills over all its requests "
                                      "(--chunked-prefill-size, default 2048, -1: "
                                      "--max-prefill-tokens; capped by --max-prefill-tokens)")
    num_running: int
    num_waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    num_inflight: int
    shutting_down: bool


# ---- request fields the routes read beyond the request models' own ------------------------
# (``model_extra``: server/tools/structured.py, server/tools/plan.py,
# server/pipeline/prompt.py and the accepted no-ops of server/openai/protocol.py);
# ``server/openapi/spec.py`` adds their schemas to the request models' ones.

class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Doc):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$",
                      description="required, as OpenAI's (server/tools/structured.py)")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Doc):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | bool | None = Field(
        None, alias="schema", description="json_object only (Together's, Fireworks' spelling)")


class StructuredOutputs(_Doc):
    """vLLM's ``structured_outputs`` (one of json, regex, choice, grammar, json_object)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: Literal[True] | None = Field(
        None, description="ferry's JSON has no free whitespace; false is a 400")
    disable_additional_properties: Literal[True] | None = Field(
        None, description="ferry's JSON has no properties beyond the schema's; false is a 400")


class StructuredFields(_Doc):
    """Output constraints (server/tools/structured.py): at most one per request."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = Field(None, min_length=1)
    structured_outputs: StructuredOutputs | None = None
    guided_decoding_backend: Literal[
        "auto", "xgrammar", "xgrammar:disable-any-whitespace", "xgrammar:no-fallback"] | None \
        = Field(None, description="ferry's backend (xgrammar): other values are a 400")
    guided_whitespace_pattern: None = Field(None, description="not supported (a 400 when set)")


class FunctionDefinition(_Doc):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of an object")
    strict: bool | None = None


class Tool(_Doc):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Doc):
    name: str


class NamedToolChoice(_Doc):
    type: Literal["function"]
    function: NamedFunction


class ToolFields(_Doc):
    """Tool calling (server/tools/plan.py), chat only."""

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


_LIMITS = _limit_schemas()


class NoopFields(_Doc):
    """Accepted no-ops (``ACCEPTED_NOOPS`` in server/openai/protocol.py): no effect; the
    bookkeeping ones within OpenAI's bounds (server/openai/field_limits.py)."""

    metadata: Any = Field(None, json_schema_extra=json_schema_of(_LIMITS["metadata"]))
    store: Any = Field(None, description="no effect (nothing is stored)")
    service_tier: Any = Field(None, json_schema_extra=json_schema_of(_LIMITS["service_tier"]))
    prediction: Any = Field(None, description="no effect")
    reasoning_effort: Any = Field(None, description="chat: the chat template's "
                                  "reasoning_effort (gpt-oss's harmony reads it; other "
                                  "templates ignore it); completions: no effect")
    verbosity: Any = Field(None, json_schema_extra=json_schema_of(_LIMITS["verbosity"]))
    prompt_cache_retention: Any = Field(None, json_schema_extra=json_schema_of(
        _LIMITS["prompt_cache_retention"]))
    prompt_cache_key: Any = Field(None, json_schema_extra=json_schema_of(dict(
        _LIMITS["prompt_cache_key"], description=f"at most {MAX_ID_LEN} characters; no effect "
                                                 "(the prefix cache is automatic)")))
    safety_identifier: Any = Field(None, json_schema_extra=json_schema_of(
        _LIMITS["safety_identifier"]))


class TokenizeFields(_Doc):
    """``/v1/tokenize`` with ``messages``: the tools the chat template shows, as on chat."""

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)


class TextPart(_Doc):
    type: Literal["text"]
    text: str


class ToolCallIn(_Doc):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageDoc(_Doc):
    """A chat message as ``messages_for_template`` (server/pipeline/prompt.py) takes it."""

    # content may be null or absent on an assistant message only
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="null only on an assistant message")
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = None
    function_call: Any = Field(None, description="accepted, no effect")
    reasoning_content: str | None = None
    refusal: Any = Field(None, description="accepted, no effect")
    annotations: Any = Field(None, description="accepted, no effect")


# ---- Anthropic's Messages API (server/anthropic/) -----------------------------------------

class AnthropicErrorDetail(_Out):
    type: str
    message: str


class AnthropicErrorResponse(_Out):
    """Every error of the Messages routes: ``{"type": "error", "error": {"type", "message"}}``
    (Anthropic's shape; ferry's 503 is Anthropic's 529 ``overloaded_error``)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(_Out):
    input_tokens: int = Field(ge=0, description="prompt tokens not read from the prefix cache")
    output_tokens: int = Field(ge=0)
    cache_read_input_tokens: int = Field(ge=0, description="prompt tokens the prefix cache "
                                                           "held")
    cache_creation_input_tokens: int = Field(ge=0)


class AnthropicMessage(_Out):
    """The ``message`` object of ``POST /v1/messages`` (content: ``text``, ``tool_use``
    and, with a reasoning parser, ``thinking`` blocks)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(_Out):
    """``POST /v1/messages/count_tokens``."""

    input_tokens: int = Field(ge=0)
