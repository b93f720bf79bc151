"""Pydantic v2 models of the OpenAI request bodies, and their mapping to ``SamplingParams``.

Bounds mirror ``SamplingParams.verify`` so a bad value is a 400 naming the field (``param``)
before anything reaches the engine. Types are strict, as in OpenAI's API: a boolean must be a
JSON boolean and an integer a JSON integer (``"5"``, ``true`` or ``2.0`` for ``n`` is a 400);
a float field takes JSON integers too. ``null`` at the top level means "absent" (OpenAI
clients send ``"stream_options": null``).

Every field of a generation request is one of three kinds (``check_unsupported``): implemented
(a declared field, or a ``SamplingParams`` field), an accepted no-op (``ACCEPTED_NOOPS``,
documented in docs/usage.md; SGLang's and vLLM's fields at their defaults,
``server/openai/extensions.py``), or refused with a 400 naming it; an unknown field is
refused too (as OpenAI does), so nothing a client sends is silently dropped.

The base model, the tokenize/detokenize bodies and the error mapping live in
``server/openai/protocol_base.py`` (re-exported here).
"""

from __future__ import annotations

import copy
import logging
import re
import typing
from typing import Any, Literal

import msgspec
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
)

from engine.sampling.params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from server.http.errors import APIError, bad_request, not_supported
from server.openai import extensions, field_limits
from server.openai.chat_checks import (  # noqa: F401 - re-exported
    RESERVED_TEMPLATE_KWARGS,
    check_chat_prompt,
    check_continuation_structure,
)
from server.openai.protocol_base import (  # noqa: F401 - re-exported
    MAX_DETOKENIZE_TOKENS,
    MAX_MESSAGES,
    MAX_N_HARD,
    ChatMessage,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
    _Base,
    _param_of,
    from_validation_error,
    json_schema_of,
    max_n_of,
    unrecognized,
)
from server.tools.structured import STRUCTURED_FIELDS, STRUCTURED_NOOPS, TOOL_REQUEST_FIELDS

logger = logging.getLogger("ferry.server")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1        # bound of token counts and ids in a request
MAX_PROMPTS = 128            # prompts in one /v1/completions request
MAX_STOP_TOKEN_IDS = MAX_STOP_STRINGS
#: a logit_bias key: a JSON string of ASCII digits, optionally signed (int() takes more)
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


class _SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions (``_SamplingRequest`` adds
    every other ``SamplingParams`` field, see ``engine_sampling_fields``)."""

    model: str | None = None
    n: int = Field(1, ge=1)  # upper bound: --max-n, checked in _n (message states it)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] = Field(default_factory=list, json_schema_extra=json_schema_of({"anyOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
        {"type": "array", "maxItems": MAX_STOP_STRINGS,
         "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}}]}))
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    # SGLang's: regular expressions (engine/sampling/stops.py); compiled and bounded by
    # SamplingParams.verify (a 400 naming stop_regex)
    stop_regex: list[str] = Field(default_factory=list, json_schema_extra=json_schema_of({
        "anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
                  {"type": "array", "maxItems": MAX_STOP_STRINGS,
                   "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}}]}))
    ignore_eos: bool = False
    logit_bias: dict[int, float] = Field(default_factory=dict, json_schema_extra=json_schema_of({
        "type": "object", "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": "^-?[0-9]{1,20}$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id (a string of digits) -> bias added to its logit"}))
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False   # vLLM: logprobs tokens as "token_id:N"
    # vLLM: the prompt's and each choice's token ids in the response (prompt_token_ids,
    # choices[i].token_ids; streamed with their chunks)
    return_token_ids: bool = False
    # vLLM: keep at most this many prompt tokens (-1: the context length), cut on
    # ``truncation_side`` (left: keep the last ones, vLLM's default); the kept ids are what
    # return_token_ids shows (server/pipeline/job.py's truncate_prompt)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM: the k most likely tokens at every prompt position (first entry null); -1 ("the
    # whole vocabulary") is refused like any k beyond MAX_LOGPROBS
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM: let the tokenizer add its special tokens (BOS...); None: the endpoint's default
    # (True for a completions prompt, False for chat: the template writes them)
    add_special_tokens: bool | None = None
    # an accepted no-op (ACCEPTED_NOOPS), declared for its type; at most 64 characters
    # (check_unsupported, server/openai/field_limits.py)
    user: str | None = Field(None, json_schema_extra=json_schema_of(
        field_limits.json_schemas()["user"]))

    @field_validator("n")
    @classmethod
    def _n(cls, v: int, info: ValidationInfo) -> int:
        limit = max_n_of(info.context)
        if v > limit:
            raise ValueError(f"n must be at most {limit} on this server")
        return v

    @field_validator("stop", "stop_regex", mode="before")
    @classmethod
    def _stop(cls, v: Any, info: ValidationInfo) -> list[str]:
        kind = ("a string", "stop strings", "stop string") if info.field_name == "stop" else \
            ("a regular expression", "stop_regex patterns", "stop_regex pattern")
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError(f"must be {kind[0]} or a list of them")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} {kind[1]} are allowed")
        for s in v:
            if not 1 <= len(s) <= MAX_STOP_LEN:
                raise ValueError(f"each {kind[2]} must have 1 to {MAX_STOP_LEN} characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 or t > INT32_MAX for t in v):
            raise ValueError("token ids must be in [0, 2**31)")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> dict[int, float]:
        if not isinstance(v, dict):
            # pydantic turns ValueError (not TypeError) into a validation error
            raise ValueError("must be an object mapping token ids (as strings) to numbers")  # noqa: TRY004
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed")
        out: dict[int, float] = {}
        not_ids, out_of_range, bad_values = [], [], []
        for k, b in v.items():
            if isinstance(k, str) and _TOKEN_ID_KEY.fullmatch(k):
                tid = int(k) if len(k) <= 20 else INT64_MAX  # spares int() a huge string
            elif isinstance(k, int) and not isinstance(k, bool):  # Python callers
                tid = k
            else:
                not_ids.append(repr(k)[:40])
                continue
            if not 0 <= tid <= INT32_MAX:
                out_of_range.append(str(k)[:24])
            elif isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
                bad_values.append(str(k))
            else:
                out[tid] = float(b)
        problems = []
        if not_ids:
            problems.append(f"keys {', '.join(not_ids)} are not token ids (strings of ASCII "
                            "digits)")
        if out_of_range:
            problems.append(f"token ids {', '.join(out_of_range)} are out of range "
                            "[0, 2**31)")
        if bad_values:
            problems.append(f"the values of {', '.join(bad_values)} are not numbers in "
                            "[-100, 100]")
        if problems:
            raise ValueError("; ".join(problems))
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per generated token to return, or None for no logprobs."""
        return None

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Alternatives per prompt token the engine computes (``prompt_logprobs``), or None."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """The engine's ``SamplingParams`` (``max_tokens`` resolved by the caller): every
        ``SamplingParams`` field from the request field of the same name, except the
        ``ENGINE_DERIVED`` ones."""
        kw = {name: copy.copy(getattr(self, name)) for name in SAMPLING_FIELDS
              if name not in ENGINE_DERIVED}
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs_k,
                              prompt_logprobs=self.prompt_logprobs_k, **kw)


#: ``SamplingParams`` fields, in order
SAMPLING_FIELDS = tuple(f.name for f in msgspec.structs.fields(SamplingParams))
#: ``SamplingParams`` fields that requests set from fields of their own: ``max_tokens`` (from
#: ``max_tokens``/``max_completion_tokens`` and the endpoint's default), ``logprobs`` and
#: ``prompt_logprobs`` (completions ``logprobs``/``echo``, chat ``logprobs``/``top_logprobs``);
#: ``think_end_id``/``think_end_ids`` are the server's, from ``--reasoning-parser``
#: (server/pipeline/reasoning.py)
ENGINE_DERIVED = frozenset({"max_tokens", "logprobs", "prompt_logprobs", "think_end_id",
                            "think_end_ids"})


def engine_sampling_fields(struct_cls: type, declared) -> dict[str, tuple]:
    """pydantic field definitions for the fields of the msgspec struct ``struct_cls`` that
    ``declared`` (a model's ``model_fields``) lacks, minus ``ENGINE_DERIVED``: the same name,
    type and default. A new ``SamplingParams`` field is thus a request field with no change
    here; its bounds are ``SamplingParams.verify``'s (a 400 naming it, raised when the
    route builds the params)."""
    hints = typing.get_type_hints(struct_cls)
    out: dict[str, tuple] = {}
    for f in msgspec.structs.fields(struct_cls):
        if f.name in declared or f.name in ENGINE_DERIVED:
            continue
        default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        out[f.name] = (hints[f.name], Field(default_factory=lambda d=default: copy.deepcopy(d)))
    return out


_SamplingRequest = create_model(
    "_SamplingRequest", __base__=_SamplingFields,
    __doc__="Every sampling field of /v1/completions and /v1/chat/completions.",
    **engine_sampling_fields(SamplingParams, _SamplingFields.model_fields))


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: str | list[str] | list[int] | list[list[int]]."""

    prompt: str | list[str] | list[list[int]] = Field(json_schema_extra=json_schema_of({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
         "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": {"type": "integer"}},
        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}}}]}))
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)  # OpenAI's completions default
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)  # must equal n (check_unsupported)
    suffix: str | None = None

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_k(self) -> int | None:
        ks = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs)
              if k is not None]
        return max(ks) if ks else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[str] | list[list[int]]:
        def is_ids(x):
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in x)

        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string, a list of strings, a list of token ids or a "  # noqa: TRY004
                             "list of lists of token ids")
        if not v:
            raise ValueError("the prompt is empty")
        if is_ids(v):
            return [v]
        if all(isinstance(x, str) for x in v) or all(is_ids(x) for x in v):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids or a list "
                         "of lists of token ids")


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is an alias of max_tokens."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # chat continuation (vLLM's names): end the prompt with the assistant header, or
    # continue the last (assistant) message where it stops; its tokens count as prompt
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # extra variables of the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


# ---- fields ferry ignores or refuses ------------------------------------------------------

#: accepted no-ops: optional fields of OpenAI's API whose only effect is bookkeeping on
#: OpenAI's side (end-user ids, stored completions, tiers, cache keys) or a hint that changes
#: no output; ferry accepts and ignores them (docs/usage.md lists them). Every other field is
#: implemented or a 400 naming it.
ACCEPTED_NOOPS = frozenset({
    "user", "metadata", "store", "service_tier", "prediction",
    "reasoning_effort", "verbosity", "prompt_cache_key", "safety_identifier",
    "prompt_cache_retention",
})
IGNORED_FIELDS = ACCEPTED_NOOPS  # the old name

def _refuse(req: BaseModel, name: str, value: Any) -> APIError | None:
    """400 for an undeclared field ``name`` unless its value is harmless (None): the value
    ferry cannot honour, or a field it does not know at all."""
    if name in STRUCTURED_FIELDS or name in STRUCTURED_NOOPS or name in TOOL_REQUEST_FIELDS:
        return None  # checked by server/tools/structured.py and server/tools/plan.py
    if name == "parallel_tool_calls":  # server/tools/plan.py reads it (chat only)
        if isinstance(req, ChatCompletionRequest) or value is None:
            return None
        return not_supported(name, "only on /v1/chat/completions")
    if name == "functions":
        return not_supported(name) if value else None
    if name == "function_call":
        return not_supported(name) if value not in (None, "none") else None
    if name == "modalities":
        return None if value in (None, ["text"]) else not_supported(name, "only ['text']")
    if name == "audio":
        return not_supported(name) if value is not None else None
    if name == "echo":  # vLLM's chat echo (repeat the last message) is not implemented
        return not_supported(name, "only on /v1/completions") if value else None
    if name in ("web_search_options", "response_schema"):
        return not_supported(name)
    if name in extensions.EXTENSION_FIELDS:  # SGLang's and vLLM's: no-ops at their defaults
        return extensions.check_extension(name, value)
    if name in ("rid", "request_id", *extensions.ROUTE_FIELDS):  # read by the routes
        return None  # (extensions.body_request_id, server/openai/lora_choice.py)
    return unrecognized(name)  # unknown to ferry: refused, never silently dropped


def check_unsupported(req: _SamplingRequest) -> None:
    """Raise a 400 ``APIError`` naming the first field ferry cannot honour.

    Covers extra fields (``tools``, ``response_format``...), known fields whose value is
    not supported yet (``best_of`` other than n, ``suffix``), ``stream_options`` without
    ``stream: true`` and chat ``top_logprobs`` > 0 without ``logprobs: true`` (OpenAI
    refuses both too); ``metadata``, ``user``, ``safety_identifier`` and
    ``prompt_cache_key`` beyond OpenAI's bounds (``server/openai/field_limits.py``).
    """
    field_limits.check_fields({**(req.model_extra or {}), "user": req.user})
    for name, value in (req.model_extra or {}).items():
        if name in ACCEPTED_NOOPS:
            continue
        err = _refuse(req, name, value)
        if err is not None:
            raise err
    extensions.body_request_id(req.model_extra or {})
    if req.stream_options is not None and not req.stream:
        # OpenAI and vLLM refuse it too; "stream_options": null is fine (dropped as absent)
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and req.best_of != req.n:
            raise not_supported("best_of", "best_of must equal n")
        if req.suffix:
            raise not_supported("suffix")
    elif isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        check_chat_prompt(req)
        check_continuation_structure(req)


def parse_request(model: type[BaseModel], body: Any, max_n: int | None = None) -> Any:
    """Validate a decoded JSON body (a generation, tokenize or detokenize request).

    Args:
        model: the request model (``CompletionRequest``...).
        body: the decoded JSON.
        max_n: the server's ``--max-n`` (default: MAX_N_HARD).
    Raises:
        APIError: 400 (not an object, a bad field, or an unsupported one). Nothing else
            escapes: an unexpected error inside validation is logged and answered as 400.
    """
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if issubclass(model, _SamplingRequest):
        body = extensions.apply_aliases(body)
    try:
        req = model.model_validate(body, context={"max_n": max_n})
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except APIError:
        raise
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except Exception:  # a validator bug must not become a 500 for a client's body
        logger.exception("unexpected error validating a %s", model.__name__)
        raise bad_request("the request body could not be validated") from None
    if isinstance(req, _SamplingRequest):
        check_unsupported(req)
    elif isinstance(req, TokenizeRequest | DetokenizeRequest):
        req.check()
        if isinstance(req, TokenizeRequest) and req.messages is not None:
            check_chat_prompt(req)
    return req
