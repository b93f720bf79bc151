"""Argument values written as text (XML-style tool calls: ``qwen3_coder``, ``glm45``) typed
by the tool's JSON schema.

A parameter the schema types as ``string`` keeps its text; ``integer``/``number`` become
numbers, ``boolean`` true/false, ``object``/``array`` parsed JSON (or a Python literal);
a value that does not fit its type, or a parameter without a schema, is read as JSON when it
is JSON and kept as text otherwise.
"""

from __future__ import annotations

import ast
import json

from server.http import json_text


def param_schema(tools: list[dict] | None, function: str, param: str) -> dict | None:
    """The JSON schema of ``function``'s parameter ``param`` in ``tools`` (OpenAI's tool
    objects or bare function objects), or None."""
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == function:
            props = (fn.get("parameters") or {}).get("properties") or {}
            prop = props.get(param) if isinstance(props, dict) else None
            return prop if isinstance(prop, dict) else None
    return None


def _types(schema: dict) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [x for s in schema[key] if isinstance(s, dict) for x in _types(s)]
    if "properties" in schema:
        return ["object"]
    if "items" in schema:
        return ["array"]
    return []


def _as_json(raw: str):
    try:
        return json_text.loads(raw)
    except json_text.JSONTextError:
        return raw


def _number(raw: str, integer: bool):
    s = raw.strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        val = float(s)
    except ValueError:
        return None
    if val != val or val in (float("inf"), float("-inf")):
        return None
    return int(val) if integer and val.is_integer() else val


def _structured(raw: str):
    try:
        return json_text.loads(raw)
    except json_text.JSONTextError:
        pass
    try:
        val = ast.literal_eval(raw.strip())
        json.dumps(val)
        return val
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def typed_value(raw: str, schema: dict | None):
    """``raw`` (a parameter's text) as the JSON value its ``schema`` asks for."""
    types = _types(schema) if schema else []
    if not types:
        return _as_json(raw)
    if "string" in types and len(types) == 1:
        return raw
    for t in types:
        if t in ("integer", "number"):
            val = _number(raw, t == "integer")
            if val is not None:
                return val
        elif t == "boolean" and raw.strip().lower() in ("true", "false"):
            return raw.strip().lower() == "true"
        elif t == "null" and raw.strip().lower() in ("null", "none"):
            return None
        elif t in ("object", "array"):
            val = _structured(raw)
            if isinstance(val, dict if t == "object" else list):
                return val
    return raw if "string" in types else _as_json(raw)


def json_item(key: str, value) -> str:
    """One ``"key": value`` member of a JSON object's text (as ``json.dumps`` writes it)."""
    return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
