"""The base of the request models, the bodies of ``/v1/tokenize`` and ``/v1/detokenize``
(vLLM's and SGLang's shapes), and pydantic errors as OpenAI errors. ``server/openai/protocol.py``
re-exports all of it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from server.http.errors import APIError, bad_request

MAX_N_HARD = 128             # upper bound of n whatever --max-n says
MAX_MESSAGES = 1024
MAX_DETOKENIZE_TOKENS = 1 << 17  # token ids in one /v1/detokenize request


class _Base(BaseModel):
    # strict: no str -> int, bool -> int, 2.0 -> int or 1/"yes" -> bool coercion; an int is
    # still a valid float (pydantic's strict float takes ints, like OpenAI's API)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Base):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False
    #: OpenAI's stream obfuscation padding: ferry never adds it (an accepted no-op)
    include_obfuscation: bool | None = None


class ChatMessage(_Base):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None



def json_schema_of(replacement: dict):
    """A ``json_schema_extra`` that replaces a field's generated JSON schema (for
    /openapi.json) with ``replacement``: the shapes a ``mode="before"`` validator accepts."""

    def apply(schema: dict) -> None:
        keep = {k: schema[k] for k in ("default", "title") if k in schema}
        schema.clear()
        schema.update(replacement, **keep)

    return apply


# ---- pydantic errors -> OpenAI errors -----------------------------------------------------

def _param_of(loc: tuple) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``; union tags dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str):
            if not part.isidentifier() or part in ("str", "int", "float", "bool", "dict",
                                                   "list"):
                continue
            out += ("." if out else "") + part
    return out or None


def unrecognized(name: str) -> APIError:
    """The 400 of a field ferry does not know (OpenAI answers "Unrecognized request argument
    supplied"): nothing a client sends is silently dropped."""
    return APIError(f"unrecognized request field '{name}' (see docs/usage.md for the fields "
                    "ferry accepts)", 400, name, "unrecognized_field")


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (``param``)."""
    errs = exc.errors(include_url=False)
    if not errs:
        return bad_request("invalid request")
    e = errs[0]
    param = _param_of(tuple(e.get("loc", ())))
    msg = str(e.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if e.get("type") == "missing":
        msg = "this field is required"
    return bad_request(f"{param}: {msg}" if param else msg, param)


def max_n_of(context: Any) -> int:
    """The largest ``n`` accepted: ``context["max_n"]`` (``--max-n``) capped at MAX_N_HARD."""
    limit = context.get("max_n") if isinstance(context, dict) else None
    return min(limit or MAX_N_HARD, MAX_N_HARD)


# ---- /v1/tokenize and /v1/detokenize ------------------------------------------------------

class TokenizeRequest(_Base):
    """``POST /v1/tokenize``: exactly one of ``prompt`` (a string) or ``messages``.

    ``add_special_tokens`` defaults to True for a prompt and False for messages (the chat
    template writes its own special tokens), as in vLLM.
    """

    model_config = ConfigDict(json_schema_extra={"oneOf": [  # null is absent
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    # the chat prompt's fields, as on /v1/chat/completions (messages only); ``tools`` and
    # ``reasoning_effort`` are read from the extra fields, as chat reads them
    # (server/tools/plan.py, server/pipeline/prompt.py)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        """Raises: APIError 400 (``param`` "prompt") unless exactly one input is given; 400
        naming a chat field sent with ``prompt``, or any field ferry does not know."""
        for name in self.model_extra or {}:
            # read from the extra fields, as on chat
            if name not in ("tools", "lora_path", "reasoning_effort"):
                raise unrecognized(name)
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send exactly one of 'prompt' (a string) or 'messages'",
                              "prompt")
        if self.prompt is not None:
            chat = {"tools": (self.model_extra or {}).get("tools"),
                    "chat_template_kwargs": self.chat_template_kwargs,
                    "continue_final_message": self.continue_final_message,
                    "reasoning_effort": (self.model_extra or {}).get("reasoning_effort")}
            for name, value in chat.items():
                if value:
                    raise bad_request(f"{name} needs 'messages' (a chat prompt)", name)


class DetokenizeRequest(_Base):
    """``POST /v1/detokenize``: ``tokens`` (ids; range-checked against the vocabulary later)."""

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)

    def check(self) -> None:
        """Raises: APIError 400 naming a field ferry does not know."""
        for name in self.model_extra or {}:
            raise unrecognized(name)

