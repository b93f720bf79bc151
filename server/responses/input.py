"""Conversion of a Responses API request's ``input``, ``instructions``, ``tools``,
``tool_choice`` and ``text`` into their ``/v1/chat/completions`` equivalents.

- ``instructions``: a system message before the input.
- ``input``: a string (one user message) or items: messages (role ``user``, ``system``,
  ``developer`` or ``assistant``; content a string or ``input_text``/``output_text`` parts),
  ``function_call`` items (consecutive ones, with the assistant text just before them, make
  one assistant turn with ``tool_calls``) and ``function_call_output`` items (``tool``
  messages with their ``tool_call_id``; its ``call_id`` must name a ``function_call`` before
  it, in the input or the ``previous_response_id`` conversation, else a 400 as OpenAI's).
- flat function tools ``{"type": "function", "name", "description", "parameters",
  "strict"}`` -> ``{"type": "function", "function": {...}}``; ``tool_choice``
  ``{"type": "function", "name"}`` -> ``{"type": "function", "function": {"name"}}``.
- ``text.format`` -> ``response_format`` (``text``: none; ``json_object``; ``json_schema``
  with ``name`` (required, OpenAI's ``^[a-zA-Z0-9_-]{1,64}$``), ``schema``, ``strict``).

Every malformed part is a 400 naming the Responses field; ``ChatConversion.rename`` turns a
chat-side error's ``param`` back into the Responses name.
"""

from __future__ import annotations

import copy
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.http.errors import APIError, bad_request, not_supported
from server.openai.field_limits import ENUM_FIELDS
from server.tools.structured import check_schema_name

ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
             "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
             "function_call_output": {"type", "call_id", "output", "id", "status"},
             # an earlier turn's reasoning: accepted and left out of the prompt (thinking
             # templates drop the reasoning of earlier turns)
             "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"}}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"},
               "json_schema": {"type", "name", "schema", "strict", "description"}}
#: chat's names of the token budget, which a Responses request calls ``max_output_tokens``
CHAT_BUDGET = re.compile(r"\bmax_(?:completion_)?tokens\b")


@dataclass
class ChatConversion:
    """A Responses request as a chat body, and where each chat message came from."""

    body: dict
    origins: list[str] = field(default_factory=list)  # per chat message: "input[3]"...

    def param(self, p: str | None) -> str | None:
        """A chat ``param`` in the Responses request's terms."""
        if not p:
            return p
        m = re.match(r"messages\[(\d+)\]", p)
        if m:
            i = int(m.group(1))
            origin = self.origins[i] if i < len(self.origins) else "input"
            rest = p[m.end():]
            if origin in ("input", "instructions") and rest.startswith(".content"):
                rest = rest[len(".content"):]  # the field is the message's content itself
            return origin + rest
        m = re.match(r"tools\[(\d+)\]\.function", p)
        if m:
            return f"tools[{m.group(1)}]" + p[m.end():]
        for old, new in (("response_format.json_schema.schema", "text.format.schema"),
                         ("response_format.json_schema", "text.format"),
                         ("response_format", "text.format"), ("messages", "input"),
                         ("max_completion_tokens", "max_output_tokens"),
                         ("max_tokens", "max_output_tokens")):
            if p == old or p.startswith(old + ".") or p.startswith(old + "["):
                return new + p[len(old):]
        return p

    def rename(self, err: APIError) -> APIError:
        """``err`` with its ``param`` and the message's mentions of it, and of chat's token
        budget (``max_tokens``, ``max_completion_tokens``: ``max_output_tokens`` here),
        renamed."""
        new = self.param(err.param)
        msg = err.message.replace(err.param, new) if err.param and new != err.param \
            else err.message
        if err.param and err.param.startswith("tools[") and new != err.param:
            msg = msg.replace("function.", "")  # chat tools nest their fields in "function"
        msg = CHAT_BUDGET.sub("max_output_tokens", msg)
        if new == err.param and msg == err.message:
            return err
        return APIError(msg, err.status, new, err.code, err.headers)


def _text_of(content: Any, where: str) -> str | list[dict]:
    """A message's content or a call's output (string, or text parts) as chat content;
    ``where`` names the field (``input[2].content``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype == "input_image":
            parts.append(_image_part(part, p))
            continue
        if ptype not in TEXT_PARTS:
            if isinstance(ptype, str) and ptype.startswith(("input_", "output_", "refusal")):
                raise not_supported(f"{p}.type", f"content part type {ptype!r} (only "
                                    "'input_text', 'output_text' and 'input_image')")
            raise bad_request(f"{p} must be an 'input_text' part", f"{p}.type")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{p}.text must be a string", f"{p}.text")
        for key, v in part.items():  # annotations/logprobs of an output_text sent back
            if key not in ("type", "text", "annotations", "logprobs") and v is not None:
                raise bad_request(f"unrecognized content part field '{key}'", f"{p}.{key}")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _image_part(part: dict, where: str) -> dict:
    """An ``input_image`` part (``image_url``: a data, file or http(s) URL; ``detail``
    accepted) as chat's ``image_url`` part. Raises: APIError 400 for a ``file_id`` (no
    Files API here) or another field."""
    for key, v in part.items():
        if key not in ("type", "image_url", "detail", "file_id") and v is not None:
            raise bad_request(f"unrecognized content part field '{key}'", f"{where}.{key}")
    if part.get("file_id") is not None:
        raise not_supported(f"{where}.file_id", "images by file_id (send image_url)")
    if not isinstance(part.get("image_url"), str):
        raise bad_request(f"{where}.image_url must be a string (a URL)", f"{where}.image_url")
    spec = {"url": part["image_url"]}
    if part.get("detail") is not None:
        spec["detail"] = part["detail"]
    return {"type": "image_url", "image_url": spec}


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return v


def _function_call(item: dict, where: str, call_ids: set[str]) -> dict:
    """A ``function_call`` item as a chat tool call; its ``call_id`` joins ``call_ids``.
    Raises: APIError 400 naming ``{where}.call_id`` for an id an earlier function_call of the
    conversation has (OpenAI: each call_id is unique), or a missing string field."""
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where),
                         "arguments": _string(item, "arguments", where)}}
    if call["id"] in call_ids:
        raise bad_request(f"{where}.call_id: duplicate call_id {call['id']!r} (an earlier "
                          "function_call of the conversation has it)", f"{where}.call_id")
    call_ids.add(call["id"])
    return call


def chat_messages(instructions: str | None, inp: str | list[dict],
                  prior: list[dict] = ()) -> tuple[list[dict], list[str]]:
    """Chat messages and their origins (``"input[3]"``...) from ``instructions`` and
    ``input``, after the ``prior`` items (a stored conversation that ``previous_response_id``
    continues; their origin is ``previous_response_id``)."""
    msgs: list[dict] = []
    origins: list[str] = []
    if instructions is not None:
        msgs.append({"role": "system", "content": instructions})
        origins.append("instructions")
    if isinstance(inp, str) and not prior:
        msgs.append({"role": "user", "content": inp})
        origins.append("input")
        return msgs, origins
    if not inp:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    items = [*prior, *([{"role": "user", "content": inp}] if isinstance(inp, str) else inp)]
    names = ["previous_response_id"] * len(prior) + (
        ["input"] if isinstance(inp, str) else [f"input[{i}]" for i in range(len(inp))])
    # the call ids an output may answer: the function_calls of the conversation before it
    # (OpenAI answers an output of an unknown call with a 400; chat's check of the tool
    # messages, server/tools/messages.py, would otherwise name chat's tool_call_id)
    call_ids: set[str] = set()
    calls_from = -1  # index of the chat message that collects consecutive function_calls
    for raw, where in zip(items, names, strict=True):
        if not isinstance(raw, dict):
            raise bad_request(f"{where} must be an object", where)
        item = {k: v for k, v in raw.items() if v is not None}
        kind = item.get("type", "message")
        if not isinstance(kind, str) or kind not in ITEM_KEYS:
            if isinstance(kind, str):
                raise not_supported(f"{where}.type", f"input item type {kind!r} (only "
                                    "'message', 'function_call', 'function_call_output' "
                                    "and 'reasoning')")
            raise bad_request(f"{where}.type must be a string", f"{where}.type")
        for key in item:
            if key not in ITEM_KEYS[kind]:
                raise bad_request(f"unrecognized input item field '{key}'", f"{where}.{key}")
        if kind == "reasoning":
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role must be one of {list(ROLES)}",
                                  f"{where}.role")
            if "content" not in item:
                raise bad_request(f"{where}.content is required", f"{where}.content")
            msgs.append({"role": role, "content": _text_of(item["content"], f"{where}.content")})
            origins.append(where)
        elif kind == "function_call":
            call = _function_call(item, where, call_ids)
            if calls_from == len(msgs) - 1 and calls_from >= 0:
                msgs[-1]["tool_calls"].append(call)
            else:
                last = msgs[-1] if msgs else None
                if last is not None and last["role"] == "assistant" and "tool_calls" not in last:
                    last["tool_calls"] = [call]  # the text before the calls: one turn
                else:
                    msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    origins.append(where)
                calls_from = len(msgs) - 1
            continue
        else:  # function_call_output
            if "output" not in item:
                raise bad_request(f"{where}.output is required", f"{where}.output")
            content = _text_of(item["output"], f"{where}.output")
            call_id = _string(item, "call_id", where)
            if call_id not in call_ids:
                raise bad_request(f"{where}.call_id: no function_call with call_id {call_id!r} "
                                  "before it in the input or the previous_response_id "
                                  "conversation for this function_call_output to answer",
                                  f"{where}.call_id")
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": content})
            origins.append(where)
        calls_from = -1
    return msgs, origins


#: id prefixes of the items a response stores, by item type (OpenAI's)
ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}


def stored_items(inp: str | list[dict]) -> list[dict]:
    """A validated ``input`` as the Responses items a stored response keeps and
    ``GET /v1/responses/{id}/input_items`` lists: every item with its ``type`` and an ``id``
    (kept when the client gave one), a string message content as one ``input_text`` part
    (``output_text``, with ``annotations``, for an assistant message)."""
    raw = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
    out = []
    for item in copy.deepcopy(raw):
        item = {k: v for k, v in item.items() if v is not None}
        kind = item.setdefault("type", "message")
        if kind == "message":
            part = "output_text" if item["role"] == "assistant" else "input_text"
            if isinstance(item["content"], str):
                item["content"] = [{"type": part, "text": item["content"]}]
            if part == "output_text":
                for p in item["content"]:
                    p.setdefault("annotations", [])
            item.setdefault("status", "completed")
        out.append({"id": f"{ITEM_ID_PREFIX[kind]}_{uuid.uuid4().hex}", **item})
    return out


def chat_tools(tools: list[dict]) -> list[dict]:
    """Flat function tools as chat tools."""
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            raise bad_request(f"{p} must be an object with a 'type'", f"{p}.type")
        if t["type"] != "function":
            raise not_supported(f"{p}.type", f"tool type {t['type']!r} (only 'function')")
        for key, v in t.items():
            if key not in TOOL_KEYS and v is not None and v is not False:
                raise bad_request(f"unrecognized function tool field '{key}'", f"{p}.{key}")
        if "name" not in t:
            raise bad_request(f"{p}.name is required", f"{p}.name")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict")
              if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict) -> str | dict:
    """A Responses ``tool_choice`` in the chat shape."""
    if isinstance(choice, str):
        return choice  # none / auto / required; anything else: server/tools/plan.py's 400
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type")
    if isinstance(kind, str) and kind != "function":
        raise not_supported("tool_choice", f"tool_choice type {kind!r}")
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': "
                      "'function', 'name': ...}", "tool_choice")


def chat_response_format(text: dict) -> dict | None:
    """The chat ``response_format`` of a Responses ``text`` object (None: free text)."""
    for key in text:
        if key not in ("format", "verbosity"):
            raise bad_request(f"unrecognized text field '{key}'", f"text.{key}")
    if text.get("verbosity") not in (None, *ENUM_FIELDS["verbosity"]):
        raise bad_request("text.verbosity must be 'low', 'medium' or 'high'", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str) \
            or fmt["type"] not in FORMAT_KEYS:
        raise bad_request("text.format must be {'type': 'text' | 'json_object' | "
                          "'json_schema', ...}", "text.format.type")
    kind = fmt["type"]
    for key in fmt:
        if key not in FORMAT_KEYS[kind]:
            raise bad_request(f"unrecognized text.format field '{key}'", f"text.format.{key}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    check_schema_name(fmt, "text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format.schema must be a JSON schema (an object)",
                          "text.format.schema")
    spec = {"name": fmt["name"], "schema": fmt["schema"]}
    if fmt.get("strict") is not None:
        if not isinstance(fmt["strict"], bool):
            raise bad_request("text.format.strict must be a boolean", "text.format.strict")
        spec["strict"] = fmt["strict"]
    return {"type": "json_schema", "json_schema": spec}
