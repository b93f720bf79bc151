"""Chat messages as the model's chat template wants them (``apply_chat_template``)."""

from __future__ import annotations

from server.errors import bad_request, not_supported
from server.protocol import ChatMessage

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}


def messages_for_template(messages: list[ChatMessage]) -> list[dict]:
    """Plain ``{"role", "content"}`` dicts for ``apply_chat_template``.

    Content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined
    with newlines). ``developer`` maps to ``system``.

    Raises:
        APIError: 400 for an unknown role, a non-text part or tool messages.
    """
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = CHAT_ROLES.get(m.role)
        if role is None:
            if m.role in ("tool", "function"):
                raise not_supported(f"{where}.role", f"role '{m.role}'")
            raise bad_request(f"unknown role '{m.role}' (expected one of "
                              f"{sorted(CHAT_ROLES)})", f"{where}.role")
        if (m.model_extra or {}).get("tool_calls"):
            raise not_supported(f"{where}.tool_calls")
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
        out.append({"role": role, "content": content})
    return out
