"""Tool-calling messages of a chat request, as chat templates want them.

An assistant message's ``tool_calls`` (OpenAI: ``[{"id", "type": "function", "function":
{"name", "arguments": "<JSON text>"}}]``) go to the template with ``arguments`` decoded to an
object, which is what the templates of Llama 3.1, Qwen 2.5, Hermes and Mistral expect
(transformers' chat-template docs do the same). OpenAI's deprecated ``function_call``
(``{"name", "arguments"}``) on an assistant message is the same as one tool call. A ``tool``
message carries ``tool_call_id``. A key outside these shapes is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from server.http import json_text
from server.http.errors import bad_request

MAX_TOOL_CALLS = 128
CALL_KEYS = frozenset({"id", "type", "function"})
FUNCTION_KEYS = frozenset({"name", "arguments"})


def _unknown_key(value: dict, allowed, where: str) -> None:
    for key in value:
        if key not in allowed:
            raise bad_request(f"unrecognized field '{key}' (allowed: "
                              f"{', '.join(sorted(allowed))})", f"{where}.{key}")


def assistant_tool_calls(value: Any, where: str) -> list[dict]:
    """Validate an assistant message's ``tool_calls`` and convert them for the template.

    Args:
        value: the message's ``tool_calls`` field as sent.
        where: the message's place, e.g. ``messages[2]`` (for ``param``).
    Raises:
        APIError: 400 naming ``{where}.tool_calls[i]...`` for a malformed call.
    """
    p = f"{where}.tool_calls"
    if not isinstance(value, list) or len(value) > MAX_TOOL_CALLS:
        raise bad_request(f"tool_calls must be a list of at most {MAX_TOOL_CALLS} calls", p)
    out = []
    for i, call in enumerate(value):
        q = f"{p}[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("a tool call needs function.name", f"{q}.function.name")
        _unknown_key(call, CALL_KEYS, q)
        _unknown_key(fn, FUNCTION_KEYS, f"{q}.function")
        if call.get("type", "function") != "function":
            raise bad_request("a tool call's type must be 'function'", f"{q}.type")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise bad_request("a tool call's id must be a string", f"{q}.id")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise bad_request("function.arguments must be a JSON string",
                              f"{q}.function.arguments")
        try:
            decoded = json_text.loads(args) if args.strip() else {}
        except json_text.JSONDepthError as exc:
            raise bad_request(f"function.arguments is {exc}", f"{q}.function.arguments"
                              ) from None
        except json_text.JSONTextError:
            decoded = args  # not JSON: kept as text; the template shows it as it is
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": decoded}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def assistant_function_call(value: Any, where: str) -> list[dict]:
    """OpenAI's deprecated ``function_call`` of an assistant message, as one tool call for
    the template (no id: the legacy shape had none).

    Raises:
        APIError: 400 naming ``{where}.function_call...`` for a malformed call.
    """
    p = f"{where}.function_call"
    if not isinstance(value, dict):
        raise bad_request("function_call must be an object with 'name' and 'arguments'", p)
    _unknown_key(value, FUNCTION_KEYS, p)
    calls = assistant_tool_calls([{"function": value}], where)
    return calls


def check_tool_replies(messages: list[dict]) -> None:
    """Each ``tool`` message answers a tool call of an earlier assistant message.

    Args:
        messages: the messages as ``messages_for_template`` gives them (one per request
            message, in order: an assistant's ``tool_calls`` converted, with their ``id``
            where the client gave one; a tool message's ``tool_call_id``).
    Raises:
        APIError: 400 naming ``messages[i].role`` for a tool message with no assistant
            message with ``tool_calls`` before it, and ``messages[i].tool_call_id`` for a
            ``tool_call_id`` that names none of those calls (OpenAI answers both with a
            400), and for a missing ``tool_call_id`` when every earlier call has an id
            (a call sent without one, which ferry accepts, may be answered without one);
            ``messages[i].tool_calls[j].id`` for an id given twice in one message. Several
            tool messages may answer one assistant message, and one may answer a call of any
            earlier assistant message.
    """
    call_ids: set[str] = set()
    calls_seen = anonymous = False
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls_seen = True
            ids = [c.get("id") for c in m["tool_calls"]]
            for j, cid in enumerate(ids):
                if cid is not None and cid in ids[:j]:
                    raise bad_request(f"duplicate tool call id {cid!r} in one assistant "
                                      "message (each call's id is unique)",
                                      f"messages[{i}].tool_calls[{j}].id")
            call_ids.update(cid for cid in ids if cid is not None)
            anonymous = anonymous or None in ids
        elif m["role"] == "tool":
            if not calls_seen:
                raise bad_request("messages with role 'tool' must be a response to a "
                                  "preceding assistant message with 'tool_calls'",
                                  f"messages[{i}].role")
            call_id = m.get("tool_call_id")
            if call_id is None and not anonymous:  # every call has an id: name the one
                raise bad_request("a tool message needs 'tool_call_id': the id of the tool "
                                  "call it answers", f"messages[{i}].tool_call_id")
            if call_id is not None and call_id not in call_ids:
                raise bad_request(f"tool_call_id {call_id!r} names no tool call of an "
                                  "earlier assistant message (its 'tool_calls' ids)",
                                  f"messages[{i}].tool_call_id")
