"""Tool-call parsers for ``tool_choice: "auto"``: model output text -> (content, calls).

One parser per model family (``--tool-call-parser``), with the formats their chat templates
teach (as in vLLM's and SGLang's parsers of the same names):

- ``hermes`` (Hermes 2/3, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one block per call (the last may lack its end tag); the text outside the
  blocks is content.
- ``llama3`` (Llama 3.1+ JSON tool calling): an optional ``<|python_tag|>`` then
  ``{"name": ..., "parameters": {...}}``, several separated by ``;``; the output must start
  with the JSON (or the tag), else it is plain content.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+), text before the marker is content.

``detect_parser`` picks one from a chat template's text for ``--tool-call-parser auto``.

The content of an output with calls (``call_content``) is the text outside the calls: the
text before the first call without its trailing whitespace, then each later stretch of
text stripped, joined by newlines; None when that is empty. A stream can send it as it comes
(only whitespace right before a call marker waits), so streamed and non-stream content are
equal. An output without a valid call is all content, as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from server.http import json_text

TOOL_CALL_PARSERS = ("hermes", "llama3", "mistral")


@dataclass
class ParsedCall:
    """One call: ``name`` and ``arguments`` as a JSON object's text."""

    name: str
    arguments: str


def _args_text(obj) -> str:
    if isinstance(obj, str):  # some models emit the arguments as a JSON string already
        try:
            json_text.loads(obj)
            return obj
        except json_text.JSONTextError:
            return json.dumps(obj, ensure_ascii=False)
    return json.dumps({} if obj is None else obj, ensure_ascii=False)


def _call(obj) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return ParsedCall(obj["name"], _args_text(args))


def _json_values(text: str, sep: str = "") -> list | None:
    """Consecutive JSON values in ``text`` (whitespace and ``sep`` between), or None."""
    i, out = 0, []
    while True:
        while i < len(text) and (text[i].isspace() or (sep and text[i] == sep)):
            i += 1
        if i >= len(text):
            return out
        try:
            val, i = json_text.raw_decode(text, i)
        except json_text.JSONTextError:
            return None
        out.append(val)


def call_content(segments: list[str]) -> str | None:
    """The content of an output with calls, from the stretches of text outside them (the
    first one: the text before the first call); see the module docstring."""
    parts = [segments[0].rstrip()] + [s.strip() for s in segments[1:]] if segments else []
    return "\n".join(p for p in parts if p) or None


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    start, end = "<tool_call>", "</tool_call>"
    if start not in text:
        return text, []
    head, rest = text.split(start, 1)
    calls, segments = [], [head]
    for block in rest.split(start):
        body, _, after = block.partition(end)
        try:
            call = _call(json_text.loads(body.strip()))
        except json_text.JSONTextError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
        segments.append(after)  # text after the call, before the next one or the end
    return call_content(segments), calls


def parse_llama3(text: str) -> tuple[str | None, list[ParsedCall]]:
    tag = "<|python_tag|>"
    content, body = None, text.strip()
    if tag in text:
        head, body = text.split(tag, 1)
        content = call_content([head])
    elif not body.startswith("{"):
        return text, []
    vals = _json_values(body, ";")
    calls = [_call(v) for v in vals or []]
    if not calls or any(c is None for c in calls):
        return text, []
    return content, calls


def parse_mistral(text: str) -> tuple[str | None, list[ParsedCall]]:
    marker = "[TOOL_CALLS]"
    if marker not in text:
        return text, []
    content, rest = text.split(marker, 1)
    calls: list[ParsedCall | None] = []
    if "[ARGS]" in rest:  # v11+: name[ARGS]{...}, repeated after further markers
        for part in rest.split(marker):
            name, _, args = part.partition("[ARGS]")
            vals = _json_values(args)
            if not name.strip() or not vals or len(vals) != 1:
                return text, []
            calls.append(ParsedCall(name.strip(), _args_text(vals[0])))
    else:
        vals = _json_values(rest)
        if not vals:
            return text, []
        for v in vals:
            calls.extend(_call(x) for x in (v if isinstance(v, list) else [v]))
    if not calls or any(c is None for c in calls):
        return text, []
    return call_content([content]), calls


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral}
#: the text that opens a call, per parser (a stream holds content back from it on)
START_MARKERS = {"hermes": ("<tool_call>",), "llama3": ("<|python_tag|>", "{"),
                 "mistral": ("[TOOL_CALLS]",)}


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a finished output; ``(text, [])`` when it holds no valid call.

    Raises:
        KeyError: an unknown parser name.
    """
    return PARSERS[parser](text)


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool format calls for, or None if it shows none."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return None
