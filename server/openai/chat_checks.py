"""The checks of a chat request's own prompt fields, shared by ``/v1/chat/completions`` and
``/v1/tokenize`` with ``messages`` (``server.openai.protocol`` calls them after validation):
``continue_final_message`` and its conventions, the ``chat_template_kwargs`` a client may
not set, and OpenAI's ``reasoning_effort`` values (``check_reasoning_effort``, also used for
Responses' ``reasoning.effort``). Each takes a ``ChatCompletionRequest`` (or a ``TokenizeRequest`` with ``messages``)
and raises a 400 ``APIError`` naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from server.http.errors import bad_request

#: OpenAI's ``reasoning_effort`` values (``openai.types.shared.ReasoningEffort``)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

#: arguments of ``apply_chat_template`` that ``chat_template_kwargs`` may not set
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
    "chat_template", "tools", "documents", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "padding", "truncation", "max_length", "return_tensors"})


def check_reasoning_effort(value: Any, param: str = "reasoning_effort") -> str | None:
    """``value`` (None: absent) if it is one of OpenAI's ``REASONING_EFFORTS``.

    Raises: APIError 400 naming ``param`` for any other value."""
    if value is None or (isinstance(value, str) and value in REASONING_EFFORTS):
        return value
    raise bad_request(f"{param} must be one of {', '.join(map(repr, REASONING_EFFORTS))} "
                      f"(got {value!r})", param)


def check_continuation_structure(req: BaseModel) -> None:
    """400 for ``continue_final_message`` with a forced structure: ``tool_choice``
    ``required`` or a named function, or ``response_format`` ``json_object``/``json_schema``.
    Their grammar would constrain only the continued part, so the whole message would not be
    the tool call or JSON document asked for (SGLang and vLLM do not combine them either).

    Raises: APIError 400 naming ``continue_final_message`` and the other field."""
    if not req.continue_final_message:
        return
    extra = req.model_extra or {}
    choice, fmt = extra.get("tool_choice"), extra.get("response_format")
    if choice == "required" or isinstance(choice, dict):
        other = f"tool_choice {choice!r}" if isinstance(choice, str) else \
            "tool_choice naming a function"
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        other = f"response_format {fmt['type']!r}"
    else:
        return
    raise bad_request(f"continue_final_message cannot be combined with {other}: the forced "
                      "structure would constrain only the continued part of the last message, "
                      "so the whole message would not follow it", "continue_final_message")


def check_chat_prompt(req: BaseModel) -> None:
    """The checks of a chat prompt's own fields (chat completions and ``/v1/tokenize`` with
    ``messages``). Raises: APIError 400 naming the field."""
    check_reasoning_effort((req.model_extra or {}).get("reasoning_effort"))
    if req.continue_final_message:
        # SGLang's convention: a continuation has no generation prompt, so leaving out
        # add_generation_prompt (default true) means false; an explicit true is vLLM's 400
        if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise bad_request("continue_final_message continues the last message, so it "
                              "takes no generation prompt: leave add_generation_prompt out "
                              "or set it false", "continue_final_message")
        req.add_generation_prompt = False
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs an assistant message last",
                          "continue_final_message")
    for key in req.chat_template_kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs may not set '{key}' (a field of its "
                              "own or fixed by the server)", f"chat_template_kwargs.{key}")
