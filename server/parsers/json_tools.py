"""The tool-call families whose calls are whole JSON or Python values: ``hermes``,
``llama3``, ``mistral`` and ``pythonic``.

An output is all content unless every call in it parses (one broken call and the output is
plain text, as the model wrote it), so a stream sends the content before the first marker
as it comes and the calls at the end (``ToolParser.partial``'s default).

- ``hermes`` (Hermes 2/3, Qwen 2.5/3; SGLang's ``qwen25``/``qwen``): ``<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>``, one block per call (the last may lack its end
  tag); the text outside the blocks is content.
- ``llama3`` (Llama 3.1+ JSON tool calling; vLLM's ``llama3_json``): an optional
  ``<|python_tag|>`` then ``{"name": ..., "parameters": {...}}``, several separated by
  ``;``; the output must start with the JSON (or the tag), else it is plain content.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+), text before the marker is content.
- ``pythonic`` (Llama 3.2+/4 pythonic templates; vLLM's ``llama4_pythonic``): a Python list
  of calls with keyword arguments, ``[get_weather(city="Paris"), noop()]``, optionally
  between ``<|python_start|>`` and ``<|python_end|>``; read with ``ast`` (literals only,
  nothing is evaluated).
"""

from __future__ import annotations

import ast
import json
import re

from server.http import json_text
from server.parsers.base import (
    ParsedCall,
    ToolParser,
    args_text,
    call_content,
    json_call,
    json_values,
)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def parse(self, text, tools=None):
        start, end = "<tool_call>", "</tool_call>"
        if start not in text:
            return text, []
        head, rest = text.split(start, 1)
        calls, segments = [], [head]
        for block in rest.split(start):
            body, _, after = block.partition(end)
            try:
                call = json_call(json_text.loads(body.strip()))
            except json_text.JSONTextError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
            segments.append(after)  # text after the call, before the next one or the end
        return call_content(segments), calls


class Llama3Parser(ToolParser):
    name = "llama3"
    markers = ("<|python_tag|>",)

    def parse(self, text, tools=None):
        tag = "<|python_tag|>"
        content, body = None, text.strip()
        if tag in text:
            head, body = text.split(tag, 1)
            content = call_content([head])
        elif not body.startswith("{"):
            return text, []
        vals = json_values(body, ";")
        calls = [json_call(v) for v in vals or []]
        if not calls or any(c is None for c in calls):
            return text, []
        return content, calls

    def safe_content_end(self, text):
        if not text.strip() or text.lstrip().startswith("{"):  # may be a call: wait
            return 0
        return super().safe_content_end(text)


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    markers = ("[TOOL_CALLS]",)

    def parse(self, text, tools=None):
        marker = "[TOOL_CALLS]"
        if marker not in text:
            return text, []
        content, rest = text.split(marker, 1)
        calls: list[ParsedCall | None] = []
        if "[ARGS]" in rest:  # v11+: name[ARGS]{...}, repeated after further markers
            for part in rest.split(marker):
                name, _, args = part.partition("[ARGS]")
                vals = json_values(args)
                if not name.strip() or not vals or len(vals) != 1:
                    return text, []
                calls.append(ParsedCall(name.strip(), args_text(vals[0])))
        else:
            vals = json_values(rest)
            if not vals:
                return text, []
            for v in vals:
                calls.extend(json_call(x) for x in (v if isinstance(v, list) else [v]))
        if not calls or any(c is None for c in calls):
            return text, []
        return call_content([content]), calls


#: where a pythonic call list may begin: ``[`` then a (dotted) name and ``(``
_PY_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
#: a tail that could still grow into such a start
_PY_TAIL = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")
_PY_CONSTANTS = {"true": True, "false": False, "null": None}


def _closing(text: str, i: int) -> int:
    """Where the bracket opened at ``text[i]`` closes (brackets in string literals
    skipped), or -1."""
    depth, quote, k = 0, "", i
    while k < len(text):
        ch = text[k]
        if quote:
            if ch == "\\":
                k += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return k
        k += 1
    return -1


def _py_value(node: ast.AST):
    """A literal argument (JSON's true/false/null spellings allowed); ValueError else."""
    if isinstance(node, ast.Name) and node.id in _PY_CONSTANTS:
        return _PY_CONSTANTS[node.id]
    if isinstance(node, ast.Dict):
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values)
                if k is not None}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_py_value(e) for e in node.elts]
    return ast.literal_eval(node)


def _py_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_py_name(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def python_calls(src: str) -> list[ParsedCall] | None:
    """The calls of ``[f(a=1), g()]`` (keyword arguments, literal values), or None."""
    try:
        tree = ast.parse(src.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                return None
            if any(k.arg is None for k in node.keywords):  # **kwargs
                return None
            args = {k.arg: _py_value(k.value) for k in node.keywords}
            calls.append(ParsedCall(_py_name(node.func), json.dumps(args, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = ("<|python_start|>",)

    def parse(self, text, tools=None):
        for m in _PY_START.finditer(text):
            i = m.start()
            j = _closing(text, i)
            calls = python_calls(text[i:j + 1]) if j >= 0 else None
            if calls:
                head = text[:i].rstrip().removesuffix("<|python_start|>")
                tail = text[j + 1:].lstrip().removeprefix("<|python_end|>")
                return call_content([head, tail]), calls
        return text, []

    def safe_content_end(self, text):
        end = super().safe_content_end(text)
        m = _PY_START.search(text)
        if m is not None:
            end = min(end, m.start())
        t = _PY_TAIL.search(text)
        if t is not None:
            end = min(end, t.start())
        return end
