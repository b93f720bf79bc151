"""Structured output: the request fields that constrain decoding, mapped onto one constraint.

Every spelling becomes one of ``SamplingParams.json_schema`` / ``regex`` / ``ebnf`` (SGLang's
own fields, accepted as they are), compiled in the engine by xgrammar
(``engine/sampling/grammar.py``):

| field | constraint |
|---|---|
| OpenAI ``response_format: {"type": "text"}`` | none |
| ``response_format: {"type": "json_object"}`` | json_schema ``{"type": "object"}`` |
| ``response_format: {"type": "json_object", "schema": {...}}`` (Together's, Fireworks') | json_schema |
| ``response_format: {"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}`` | json_schema |
| SGLang ``json_schema`` (string), ``regex``, ``ebnf`` | themselves |
| vLLM ``guided_json`` (object or string), ``guided_regex``, ``guided_grammar`` | json_schema, regex, ebnf |
| vLLM ``guided_choice`` (list of strings) | ebnf ``root ::= "a" \\| "b"`` |
| vLLM ``structured_outputs: {json, regex, choice, grammar, json_object}`` | as above |

More than one constraint in a request is a 400 naming them; a constraint xgrammar cannot
parse is a 400 naming its field (the parse runs in a worker thread, milliseconds). Nothing
inside these fields is silently dropped: an unknown key (``response_format.json_schema.x``),
a value of the wrong type (``strict: "yes"``) or an option ferry does not honour is a 400
naming it; ``json_schema.name`` is required and must match OpenAI's
``^[a-zA-Z0-9_-]{1,64}$`` (``check_schema_name``). ferry's JSON is compact and closed, so
the peers' whitespace and additional-properties options are accepted only where they ask
for that (``disable_any_whitespace: true``, ``disable_additional_properties: true``,
``guided_decoding_backend: "xgrammar"``); ``whitespace_pattern`` /
``guided_whitespace_pattern`` and the opposite values are 400s.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import msgspec

from engine.sampling.grammar import check_grammar
from engine.sampling.params import SamplingParams
from server.http import json_text
from server.http.errors import bad_request, not_supported

#: request fields (besides SGLang's ``json_schema``/``regex``/``ebnf``) this module reads
STRUCTURED_FIELDS = frozenset({"response_format", "guided_json", "guided_regex",
                               "guided_choice", "guided_grammar", "structured_outputs"})
#: tool calling's request fields (server/tools/plan.py; ``tools`` is a 400 outside chat)
TOOL_REQUEST_FIELDS = frozenset({"tools", "tool_choice"})
#: vLLM's knobs of its guided-decoding backends: read by ``constraints_of``, which accepts
#: only the values that describe what ferry does (xgrammar, no free whitespace)
STRUCTURED_NOOPS = frozenset({"guided_decoding_backend", "guided_whitespace_pattern"})
#: ``guided_decoding_backend`` values ferry is: vLLM's names, with its old option suffixes
#: that state ferry's behaviour
BACKENDS = frozenset({"auto", "xgrammar", "xgrammar:disable-any-whitespace",
                      "xgrammar:no-fallback"})
#: keys of ``response_format.json_schema`` (OpenAI's; ``json_schema`` is an old alias of
#: ``schema``)
JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict", "json_schema"})
#: vLLM's ``structured_outputs`` options: the value each must have (what ferry does); None:
#: any boolean
SO_OPTIONS = {"disable_any_whitespace": True, "disable_additional_properties": True,
              "disable_fallback": None}
#: OpenAI's ``response_format.json_schema.name`` (required): 1 to 64 letters, digits, ``_``
#: and ``-``; Responses' ``text.format.name`` alike
SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_CHOICES = 1024
ANY_OBJECT = '{"type": "object"}'


def _no_other_keys(value: dict, allowed, param: str) -> None:
    """400 naming ``param.key`` for the first key of ``value`` outside ``allowed``."""
    for key in value:
        if key not in allowed:
            raise bad_request(f"unrecognized field '{key}' in {param} (allowed: "
                              f"{', '.join(sorted(allowed))})", f"{param}.{key}")


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object (or a boolean) or as a JSON string -> its text."""
    if isinstance(value, str):
        try:
            json_text.loads(value)
        except json_text.JSONTextError as exc:
            raise bad_request(f"{param} is not valid JSON ({exc})", param) from None
        return value
    if isinstance(value, dict | bool):
        try:
            json_text.check_depth(value)
        except json_text.JSONTextError as exc:
            raise bad_request(f"{param} is {exc}", param) from None
        return json.dumps(value)
    raise bad_request(f"{param} must be a JSON schema (an object)", param)


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return value


def check_schema_name(spec: dict, param: str) -> str:
    """The ``name`` of a json_schema format (``spec``), which OpenAI requires.

    Raises: APIError 400 naming ``param`` when it is missing, not a string or not 1 to 64
    of ``a-z``, ``A-Z``, ``0-9``, ``_`` and ``-`` (``SCHEMA_NAME``)."""
    name = spec.get("name")
    if name is None:
        raise bad_request(f"{param} is required (1 to 64 characters: a-z, A-Z, 0-9, _ and -)",
                          param)
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise bad_request(f"{param} must be 1 to 64 characters of a-z, A-Z, 0-9, _ and - "
                          f"(got {shown})", param)
    return name


def choice_grammar(choices: Any, param: str) -> str:
    """vLLM's ``guided_choice``: an EBNF grammar matching exactly one of the strings."""
    if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)):
        raise bad_request(f"{param} must be a list of 1 to {MAX_CHOICES} non-empty strings",
                          param)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _response_format(value: Any) -> tuple[str, str, str] | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a 'type'", param)
    kind = value["type"]
    if kind == "text":
        _no_other_keys(value, {"type"}, param)
        return None
    if kind == "json_object":
        _no_other_keys(value, {"type", "schema"}, param)
        if value.get("schema") is not None:  # Together's and Fireworks' spelling
            return f"{param}.schema", "json_schema", _schema_text(value["schema"],
                                                                  f"{param}.schema")
        return param, "json_schema", ANY_OBJECT
    if kind == "json_schema":
        _no_other_keys(value, {"type", "json_schema"}, param)
        spec = value.get("json_schema")
        p = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a 'name' "
                              "(and optionally 'schema', 'description', 'strict')", p)
        _no_other_keys(spec, JSON_SCHEMA_KEYS, p)
        check_schema_name(spec, f"{p}.name")
        if not isinstance(spec.get("description", ""), str):
            raise bad_request("response_format.json_schema.description must be a string",
                              f"{p}.description")
        if not isinstance(spec.get("strict", False), bool | None):
            # the output always matches the schema exactly: strict true or false alike
            raise bad_request("response_format.json_schema.strict must be a boolean",
                              f"{p}.strict")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            return param, "json_schema", ANY_OBJECT
        return f"{p}.schema", "json_schema", _schema_text(schema, f"{p}.schema")
    raise not_supported(f"{param}.type", f"response_format type {kind!r}; use 'text', "
                                          "'json_object' or 'json_schema'")


def _structured_outputs(value: Any) -> list[tuple[str, str, str]]:
    p = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", p)
    out = []
    for key, v in value.items():
        if v is None or (v is False and key not in SO_OPTIONS):
            continue
        q = f"{p}.{key}"
        if key == "json":
            out.append((q, "json_schema", _schema_text(v, q)))
        elif key == "json_object":
            out.append((q, "json_schema", ANY_OBJECT))
        elif key == "regex":
            out.append((q, "regex", _string(v, q)))
        elif key == "grammar":
            out.append((q, "ebnf", _string(v, q)))
        elif key == "choice":
            out.append((q, "ebnf", choice_grammar(v, q)))
        elif key in SO_OPTIONS:
            want = SO_OPTIONS[key]
            if not isinstance(v, bool):
                raise bad_request(f"{q} must be a boolean", q)
            if want is not None and v is not want:
                raise not_supported(q, f"{q}: {v}; ferry's JSON has no free whitespace and no "
                                       "properties beyond the schema's")
        else:  # whitespace_pattern (xgrammar has none), structural_tag, unknown keys
            raise not_supported(q)
    return out


def _backend_options(extra: dict) -> None:
    """vLLM's ``guided_decoding_backend`` / ``guided_whitespace_pattern``: 400 unless they
    describe what ferry does."""
    backend = extra.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise not_supported("guided_decoding_backend", f"guided_decoding_backend {backend!r}; "
                                                       "ferry's backend is xgrammar")
    if extra.get("guided_whitespace_pattern") is not None:
        raise not_supported("guided_whitespace_pattern", "a whitespace pattern (ferry's JSON "
                                                         "has no free whitespace)")


def constraints_of(req) -> list[tuple[str, str, str]]:
    """Every constraint a request sets, as ``(param, kind, text)``.

    Args:
        req: a validated completion or chat request (pydantic model; extras in
            ``model_extra``).
    Raises:
        APIError: 400 for a malformed field (naming it).
    """
    found = []
    for kind in ("json_schema", "regex", "ebnf"):  # SGLang's, declared SamplingParams fields
        v = getattr(req, kind, None)
        if v is not None:
            if kind == "json_schema":
                v = _schema_text(v, kind)
            found.append((kind, kind, v))
    extra = req.model_extra or {}
    _backend_options(extra)
    for name, v in extra.items():
        if v is None:
            continue
        if name == "response_format":
            c = _response_format(v)
            if c is not None:
                found.append(c)
        elif name == "guided_json":
            found.append((name, "json_schema", _schema_text(v, name)))
        elif name == "guided_regex":
            found.append((name, "regex", _string(v, name)))
        elif name == "guided_grammar":
            found.append((name, "ebnf", _string(v, name)))
        elif name == "guided_choice":
            found.append((name, "ebnf", choice_grammar(v, name)))
        elif name == "structured_outputs":
            found.extend(_structured_outputs(v))
    return found


def one_constraint(found: list[tuple[str, str, str]]) -> tuple[str, str, str] | None:
    """The single constraint of ``found``; 400 naming them when there are several."""
    if len(found) > 1:
        names = ", ".join(p for p, _, _ in found)
        raise bad_request(f"at most one output constraint may be set; got {names}",
                          found[1][0])
    return found[0] if found else None


async def check(param: str, kind: str, text: str) -> None:
    """400 naming ``param`` if xgrammar cannot parse the constraint (in a worker thread)."""
    try:
        await asyncio.to_thread(check_grammar, kind, text)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc.args[0]}", param) from None


def with_constraint(sp: SamplingParams, kind: str | None, text: str | None) -> SamplingParams:
    """``sp`` with exactly the given constraint (the others cleared)."""
    fields = {"json_schema": None, "regex": None, "ebnf": None}
    if kind is not None:
        fields[kind] = text
    return msgspec.structs.replace(sp, **fields)


async def constrain(req, sp: SamplingParams) -> SamplingParams:
    """The request's ``SamplingParams`` with its constraint set and checked.

    Raises:
        APIError: 400 for two constraints, a malformed field or a constraint xgrammar
            rejects (``param`` names the field); ``tools`` outside chat.
    """
    for name in ("tools", "tool_choice"):
        if (req.model_extra or {}).get(name) not in (None, "none", []):
            raise not_supported(name, f"{name} is only supported on /v1/chat/completions")
    c = one_constraint(constraints_of(req))
    if c is None:
        return sp
    await check(*c)
    return with_constraint(sp, c[1], c[2])
