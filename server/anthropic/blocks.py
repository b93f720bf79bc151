"""Anthropic's ``system``, ``messages``, ``tools`` and ``tool_choice`` as their
``/v1/chat/completions`` equivalents.

- ``system``: a string or ``text`` blocks -> one ``system`` message first.
- ``messages``: roles ``user`` and ``assistant``; content a string or blocks:
  ``text`` -> text parts; an assistant's ``tool_use`` -> its ``tool_calls`` (``input`` as
  JSON arguments); a user's ``tool_result`` -> a ``tool`` message with its
  ``tool_call_id`` (content a string or ``text`` blocks; ``is_error: true`` prefixes the
  text with ``"Error: "``, the chat templates having no error flag), placed before the
  user's text as Anthropic orders them; its ``tool_use_id`` must name a ``tool_use`` block
  of the message just before (else Anthropic's 400 "unexpected `tool_use_id`"); an assistant's ``thinking`` -> its
  ``reasoning_content`` (for templates that show it); ``redacted_thinking`` is accepted and
  dropped (ferry cannot read it). A user's ``image`` (``source``: ``base64`` with its
  ``media_type``, or ``url``, which the server fetches only from ``--allowed-media-domains``)
  -> an ``image_url`` part. ``document`` and the server tools' blocks are a 400 naming the
  block. ``cache_control`` and ``citations`` on a
  block are accepted no-ops (the radix cache caches every prompt prefix by itself).
- ``tools``: ``{name, description, input_schema}`` (``type: "custom"``; ``cache_control``,
  ``strict``... no-ops) -> chat's function tools; a server tool (``web_search_...``,
  ``bash_...``) is a 400 naming it.
- ``tool_choice``: ``auto``, ``any`` (chat's ``required``), ``tool`` with a ``name`` (a
  named function), ``none``; ``disable_parallel_tool_use`` -> ``parallel_tool_calls:
  false``.

``Origins`` remembers which Anthropic field each chat message came from, so an error the
chat side raises names the Anthropic field (``Origins.rename``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from server.http.errors import APIError, bad_request, not_supported

#: keys each input block may carry (others are a 400 naming them)
BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control", "caller"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature", "cache_control"},
    "redacted_thinking": {"type", "data", "cache_control"},
    "image": {"type", "source", "cache_control"},
}
#: media types of a base64 image block
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
#: blocks ferry cannot read yet: a 400 naming the block
UNSUPPORTED_BLOCKS = {"document": "document blocks",
                      "search_result": "search_result blocks",
                      "container_upload": "container_upload blocks"}
#: keys of a custom tool
TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control",
                       "strict", "input_examples", "defer_loading", "eager_input_streaming",
                       "allowed_callers"})
TOOL_CHOICE_KEYS = {"auto": {"type", "disable_parallel_tool_use"},
                    "any": {"type", "disable_parallel_tool_use"},
                    "tool": {"type", "name", "disable_parallel_tool_use"},
                    "none": {"type"}}


def _keys(obj: dict, allowed, where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise bad_request(f"{where}.{key}: Extra inputs are not permitted", f"{where}.{key}")


def _block(obj: Any, where: str) -> str:
    """The ``type`` of the block ``obj``, its keys checked. Raises: APIError 400."""
    kind = obj.get("type") if isinstance(obj, dict) else None
    if not isinstance(kind, str):
        raise bad_request(f"{where}: a content block must be an object with a 'type'",
                          f"{where}.type")
    if kind in UNSUPPORTED_BLOCKS:
        raise not_supported(f"{where}.type", UNSUPPORTED_BLOCKS[kind])
    if kind not in BLOCK_KEYS:
        raise bad_request(f"{where}.type: unknown or unsupported content block type {kind!r}",
                          f"{where}.type")
    _keys(obj, BLOCK_KEYS[kind], where)
    return kind


def _string(obj: dict, key: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        what = "Field required (a string)" if v is None else "expected a string"
        raise bad_request(f"{where}.{key}: {what}", f"{where}.{key}")
    return v


def text_of(content: Any, where: str) -> str:
    """A string, or ``text`` blocks joined with newlines (``system``, a tool result)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or a list of text blocks", where)
    texts = []
    for j, b in enumerate(content):
        p = f"{where}[{j}]"
        if _block(b, p) != "text":
            raise bad_request(f"{p}.type: expected a 'text' block", f"{p}.type")
        texts.append(_string(b, "text", p))
    return "\n".join(texts)


@dataclass
class Origins:
    """Per chat message, the Anthropic field it came from (``system``, ``messages[2]``,
    ``messages[2].content[0]``); per user message, the block each content part came from
    (``parts[i][j]``: chat ``messages[i].content[j]``, the tool results taken out)."""

    where: list[str] = field(default_factory=list)
    parts: dict[int, list[str]] = field(default_factory=dict)

    def param(self, p: str | None) -> str | None:
        """A chat ``param`` in the Messages request's terms (a chat image part's
        ``.image_url`` is the ``image`` block's ``.source``)."""
        if not p:
            return p
        m = re.match(r"messages\[(\d+)\]\.content\[(\d+)\]", p)
        if m and int(m.group(2)) < len(self.parts.get(int(m.group(1)), ())):
            rest = re.sub(r"^\.image_url(\.url)?(?=$|[.\[])", ".source", p[m.end():])
            return self.parts[int(m.group(1))][int(m.group(2))] + rest
        m = re.match(r"messages\[(\d+)\]", p)
        if m:
            i = int(m.group(1))
            return (self.where[i] if i < len(self.where) else "messages") + p[m.end():]
        m = re.match(r"tools\[(\d+)\]\.function\.parameters", p)
        if m:
            return f"tools[{m.group(1)}].input_schema" + p[m.end():]
        m = re.match(r"tools\[(\d+)\]\.function", p)
        if m:
            return f"tools[{m.group(1)}]" + p[m.end():]
        if p == "continue_final_message":  # the prefill: the last message
            return self.where[-1] if self.where else "messages"
        for old, new in (("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"),
                         ("response_format", "output_config.format"),
                         ("chat_template_kwargs", "thinking")):
            if p == old or p.startswith((old + ".", old + "[")):
                return new + p[len(old):]
        return p

    def rename(self, err: APIError) -> APIError:
        """``err`` naming the Messages field instead of the chat one."""
        new = self.param(err.param)
        if new == err.param:
            return err
        msg = err.message.replace(err.param, new).replace("max_completion_tokens",
                                                           "max_tokens")
        return APIError(msg, err.status, new, err.code, err.headers)


def _tool_result(b: dict, where: str, answered: set[str], uses: frozenset[str]) -> dict:
    """A ``tool_result`` block as a chat ``tool`` message; ``uses``: the ``tool_use`` ids of
    the message before (an assistant's, else none).

    Raises: APIError 400 naming the block's field: a ``tool_use_id`` of no block of
    ``uses`` (Anthropic's "unexpected `tool_use_id`"), a malformed ``content`` or
    ``is_error``."""
    call_id = _string(b, "tool_use_id", where)
    if call_id in answered:
        raise bad_request(f"{where}.tool_use_id: each `tool_use` must have a single result. "
                          f"Found multiple `tool_result` blocks with id: {call_id}",
                          f"{where}.tool_use_id")
    if call_id not in uses:
        raise bad_request(f"{where}.tool_use_id: unexpected `tool_use_id` found in "
                          f"`tool_result` blocks: {call_id}. Each `tool_result` block must "
                          "have a corresponding `tool_use` block in the previous message.",
                          f"{where}.tool_use_id")
    content = b.get("content", "")
    text = text_of(content, f"{where}.content") if content is not None else ""
    is_error = b.get("is_error", False)
    if not isinstance(is_error, bool):
        raise bad_request(f"{where}.is_error: expected a boolean", f"{where}.is_error")
    if is_error:
        text = "Error: " + text
    answered.add(call_id)
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tool_use(b: dict, where: str) -> dict:
    args = b.get("input")
    if not isinstance(args, dict):
        raise bad_request(f"{where}.input: expected an object", f"{where}.input")
    return {"id": _string(b, "id", where), "type": "function",
            "function": {"name": _string(b, "name", where),
                         "arguments": json.dumps(args, ensure_ascii=False)}}


def _image(b: dict, where: str) -> dict:
    """An ``image`` block as chat's ``image_url`` part (a data URL for ``base64``).
    Raises: APIError 400 naming the field of a malformed source."""
    src = b.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        _keys(src, {"type", "media_type", "data"}, f"{where}.source")
        if src.get("media_type") not in IMAGE_MEDIA_TYPES:
            raise bad_request(f"{where}.source.media_type: expected one of "
                              f"{', '.join(IMAGE_MEDIA_TYPES)}", f"{where}.source.media_type")
        url = f"data:{src['media_type']};base64,{_string(src, 'data', f'{where}.source')}"
    elif kind == "url":
        _keys(src, {"type", "url"}, f"{where}.source")
        url = _string(src, "url", f"{where}.source")
    else:
        raise bad_request(f"{where}.source: an image source must be of type 'base64' or "
                          "'url'", f"{where}.source.type")
    return {"type": "image_url", "image_url": {"url": url}}


def _user(content: list, where: str, out: list[dict], origins: Origins,
          uses: frozenset[str]) -> None:
    parts: list[dict] = []
    part_where: list[str] = []
    seen: set[str] = set()
    for j, b in enumerate(content):
        p = f"{where}.content[{j}]"
        kind = _block(b, p)
        if kind == "text":
            parts.append({"type": "text", "text": _string(b, "text", p)})
            part_where.append(p)
        elif kind == "image":
            parts.append(_image(b, p))
            part_where.append(p)
        elif kind == "tool_result":
            out.append(_tool_result(b, p, seen, uses))
            origins.where.append(p)
        else:
            raise bad_request(f"{p}.type: a user message cannot carry {kind!r} blocks",
                              f"{p}.type")
    if parts or not seen:
        origins.parts[len(out)] = part_where
        out.append({"role": "user", "content": parts})
        origins.where.append(where)


def _assistant(content: list, where: str) -> dict:
    texts, calls, thinking = [], [], []
    for j, b in enumerate(content):
        p = f"{where}.content[{j}]"
        kind = _block(b, p)
        if kind == "text":
            texts.append(_string(b, "text", p))
        elif kind == "tool_use":
            calls.append(_tool_use(b, p))
            if any(c["id"] == calls[-1]["id"] for c in calls[:-1]):
                raise bad_request(f"{p}.id: `tool_use` ids must be unique (found "
                                  f"{calls[-1]['id']} twice)", f"{p}.id")
        elif kind == "thinking":
            thinking.append(_string(b, "thinking", p))
        elif kind != "redacted_thinking":
            raise bad_request(f"{p}.type: an assistant message cannot carry {kind!r} "
                              "blocks", f"{p}.type")
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


def chat_messages(system: Any, messages: list[Any]) -> tuple[list[dict], Origins]:
    """Chat messages of ``system`` and ``messages``, and where each came from.

    Raises: APIError 400 naming the field (an unknown role, empty content but on a final
    assistant message, a malformed or unsupported block, a block on the wrong role, a
    ``tool_use`` id twice in one message, a ``tool_result`` whose ``tool_use_id`` names no
    ``tool_use`` block of the message just before it or answers one a second time)."""
    out: list[dict] = []
    origins = Origins()
    if system is not None:
        out.append({"role": "system", "content": text_of(system, "system")})
        origins.where.append("system")
    uses: frozenset[str] = frozenset()  # the tool_use ids a tool_result may answer
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: expected an object with 'role' and 'content'", where)
        _keys(m, {"role", "content"}, where)
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: unknown role {role!r} (expected 'user' or "
                              "'assistant')", f"{where}.role")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise bad_request(f"{where}.content: expected a string or a list of content "
                              "blocks", f"{where}.content")
        if not content and not (role == "assistant" and i == len(messages) - 1):
            raise bad_request(f"{where}.content: all messages must have non-empty content "
                              "except for the optional final assistant message",
                              f"{where}.content")
        if role == "user":
            _user(content, where, out, origins, uses)
            uses = frozenset()
        else:
            out.append(_assistant(content, where))
            origins.where.append(where)
            uses = frozenset(c["id"] for c in out[-1].get("tool_calls", ()))
    return out, origins


def chat_tools(tools: Any) -> list[dict]:
    """Chat function tools of Anthropic's custom tools.

    Raises: APIError 400 naming the tool (a server tool, a missing ``input_schema``...)."""
    if not isinstance(tools, list):
        raise bad_request("tools: expected a list of tools", "tools")
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{p}: expected an object", p)
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise not_supported(f"{p}.type", f"server tool {kind!r} (only custom tools, "
                                "which the client runs)")
        _keys(t, TOOL_KEYS, p)
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"{p}.input_schema: Field required (a JSON schema object)",
                              f"{p}.input_schema")
        # OpenAI's key order (name, description, parameters): the chat template writes the
        # tool as given, so the same tool sent to chat and to Messages is the same prompt
        fn: dict = {"name": _string(t, "name", p)}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> tuple[str | dict, bool | None]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls`` (None: the default) of Anthropic's
    ``tool_choice``. Raises: APIError 400 naming the field."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in TOOL_CHOICE_KEYS:
        raise bad_request("tool_choice.type: expected 'auto', 'any', 'tool' or 'none'",
                          "tool_choice.type")
    _keys(choice, TOOL_CHOICE_KEYS[kind], "tool_choice")
    single = choice.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use: expected a boolean",
                          "tool_choice.disable_parallel_tool_use")
    parallel = None if single is None else not single
    if kind == "tool":
        return {"type": "function", "function": {"name": _string(choice, "name",
                                                                 "tool_choice")}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
