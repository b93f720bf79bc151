"""Chat messages as the model's chat template wants them (``apply_chat_template``)."""

from __future__ import annotations

from server.http.errors import bad_request, not_supported
from server.openai.protocol import ChatMessage
from server.tools.messages import assistant_tool_calls

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}
#: message fields passed to the chat template as they are (besides role and content)
TEMPLATE_FIELDS = ("name", "reasoning_content", "tool_call_id")
#: message fields accepted and ignored: OpenAI's record of an assistant turn
MESSAGE_NOOPS = frozenset({"refusal", "annotations"})
#: message fields of tool calling (server/tools/messages.py converts tool_calls)
TOOL_FIELDS = frozenset({"tool_calls", "tool_call_id", "function_call"})


def messages_for_template(messages: list[ChatMessage]) -> list[dict]:
    """Plain ``{"role", "content"}`` dicts for ``apply_chat_template``.

    Content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined
    with newlines). ``developer`` maps to ``system``. ``name`` and ``reasoning_content`` go
    to the template; ``refusal`` and ``annotations`` are accepted no-ops.

    Raises:
        APIError: 400 for an unknown role, a non-text part, tool messages or any other
            message field (named, e.g. ``messages[1].audio``).
    """
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = CHAT_ROLES.get(m.role) or ("tool" if m.role == "tool" else None)
        if role is None:
            if m.role == "function":
                raise not_supported(f"{where}.role", f"role '{m.role}'")
            raise bad_request(f"unknown role '{m.role}' (expected one of "
                              f"{sorted(CHAT_ROLES)})", f"{where}.role")
        extra = m.model_extra or {}
        tool_calls = assistant_tool_calls(extra["tool_calls"], where) \
            if extra.get("tool_calls") and role == "assistant" else None
        for key in extra:
            if key not in MESSAGE_NOOPS and key not in TOOL_FIELDS and key != "reasoning_content":
                raise bad_request(f"unrecognized message field '{key}'", f"{where}.{key}")
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
