"""The prompt of a chat request: its messages as the model's chat template wants them
(``messages_for_template``), rendered and tokenized (``chat_prompt``).

``chat_prompt`` is the one function that turns a chat request into prompt token ids: chat
completions, ``/v1/responses`` (through ``server/pipeline/job.py``'s ``prepare``) and
``/v1/tokenize`` with ``messages`` all call it, so ``/v1/tokenize`` counts exactly the tokens
the chat request would run (its ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs`` and ``tools``).
"""

from __future__ import annotations

from typing import Any

from server.http.errors import bad_request, not_supported
from server.tokenizer_manager import TokenizerManager
from server.tools.messages import assistant_function_call, assistant_tool_calls
from server.tools.plan import ToolPlan

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}
#: message fields passed to the chat template as they are (besides role and content)
TEMPLATE_FIELDS = ("name", "reasoning_content", "tool_call_id")
#: message fields accepted and ignored: OpenAI's record of an assistant turn
MESSAGE_NOOPS = frozenset({"refusal", "annotations"})
#: message fields of tool calling (server/tools/messages.py converts tool_calls), and the
#: roles that may carry each (elsewhere a 400: they would be dropped)
TOOL_FIELDS = {"tool_calls": "assistant", "function_call": "assistant", "tool_call_id": "tool"}
#: keys of a content part
PART_KEYS = frozenset({"type", "text"})


def messages_for_template(messages: list[Any]) -> list[dict]:
    """Plain ``{"role", "content"}`` dicts for ``apply_chat_template``.

    Content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined
    with newlines). ``developer`` maps to ``system``. ``name`` and ``reasoning_content`` go
    to the template; ``refusal`` and ``annotations`` are accepted no-ops. An assistant's
    ``tool_calls`` (or its deprecated ``function_call``: one call) and a tool message's
    ``tool_call_id`` go to the template too.

    Raises:
        APIError: 400 for an unknown role, a non-text part, a tool-calling field on a role
            that cannot carry it (``tool_calls`` on a user message...), both ``tool_calls``
            and ``function_call``, or any other field, of the message or of a part (named,
            e.g. ``messages[1].audio``, ``messages[0].content[2].cache_control``).
    """
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = CHAT_ROLES.get(m.role) or ("tool" if m.role == "tool" else None)
        if role is None:
            if m.role == "function":
                raise not_supported(f"{where}.role", f"role '{m.role}'")
            raise bad_request(f"unknown role '{m.role}' (expected one of "
                              f"{sorted([*CHAT_ROLES, 'tool'])})", f"{where}.role")
        extra = m.model_extra or {}
        for key in extra:
            if key not in MESSAGE_NOOPS and key not in TOOL_FIELDS and key != "reasoning_content":
                raise bad_request(f"unrecognized message field '{key}'", f"{where}.{key}")
            if key in TOOL_FIELDS and extra[key] not in (None, []) and role != TOOL_FIELDS[key]:
                raise bad_request(f"'{key}' is only allowed on {TOOL_FIELDS[key]} messages "
                                  f"(this one is a '{m.role}' message)", f"{where}.{key}")
        tool_calls = assistant_tool_calls(extra["tool_calls"], where) \
            if extra.get("tool_calls") else None
        if extra.get("function_call") is not None:
            if tool_calls:
                raise bad_request("send either tool_calls or the deprecated function_call, "
                                  "not both", f"{where}.function_call")
            tool_calls = assistant_function_call(extra["function_call"], where)
        content = m.content
        if content is None:
            if role != "assistant":
                raise bad_request("content is required", f"{where}.content")
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                ptype = part.get("type")
                if ptype != "text":
                    raise bad_request(f"content part type {ptype!r} is not supported (only "
                                      "'text')", f"{where}.content[{j}].type")
                for key in part:
                    if key not in PART_KEYS:
                        raise bad_request(f"unrecognized content part field '{key}'",
                                          f"{where}.content[{j}].{key}")
                text = part.get("text")
                if not isinstance(text, str):
                    raise bad_request("a text part needs a string 'text'",
                                      f"{where}.content[{j}].text")
                texts.append(text)
            content = "\n".join(texts)
        msg = {"role": role, "content": content}
        for key in TEMPLATE_FIELDS:
            value = m.name if key == "name" else extra.get(key)
            if isinstance(value, str):
                msg[key] = value
        if tool_calls:
            msg["tool_calls"] = tool_calls
        out.append(msg)
    return out


async def chat_prompt(tm: TokenizerManager, req: Any, tools: ToolPlan) -> list[int]:
    """The prompt token ids of a chat request (a ``ChatCompletionRequest`` or a
    ``TokenizeRequest`` with ``messages``): its messages through the model's chat template
    with its ``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``,
    ``chat_template_kwargs``, the tools of ``tools`` and OpenAI's ``reasoning_effort``
    (the template variable of that name, for the templates that read it: gpt-oss's;
    ``chat_template_kwargs.reasoning_effort`` wins).

    Raises:
        APIError: 400 naming the message or field the template rejects, or a
            ``reasoning_effort`` that is not a string.
    """
    kwargs = dict(req.chat_template_kwargs or {}, **tools.template_kwargs)
    effort = (getattr(req, "model_extra", None) or {}).get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise bad_request("reasoning_effort must be a string (e.g. 'low', 'medium', "
                              "'high')", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
    return await tm.chat.apply_chat_template(
        messages_for_template(req.messages), req.add_generation_prompt,
        bool(req.add_special_tokens), continue_final_message=req.continue_final_message,
        template_kwargs=kwargs)
