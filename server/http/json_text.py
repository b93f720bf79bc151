"""JSON held in strings: client fields (schemas given as text, tool-call arguments) and model
output (tool calls). One parser for all of them, so that no input can end in a 5xx.

``json.loads`` raises ``RecursionError`` (not a ``ValueError``) on deeply nested text, and a
deeply nested value also breaks ``json.dumps`` and the grammar compiler later on. ``loads``
turns both into :class:`JSONTextError`, a ``ValueError``, and bounds the nesting depth.
"""

from __future__ import annotations

import json
from typing import Any

#: deepest nesting of arrays/objects accepted in JSON held in a string, and in a JSON schema
#: (schemas of real tools nest a few levels; each level of an object schema is two levels of
#: JSON: ``properties`` and the property's schema). Documented in docs/usage.md ("Limits").
MAX_JSON_DEPTH = 64


class JSONTextError(ValueError):
    """Invalid JSON, or JSON nested deeper than the limit (the message says which)."""


class JSONDepthError(JSONTextError):
    """JSON nested deeper than the limit (valid or not)."""


def _too_deep(max_depth: int) -> JSONDepthError:
    return JSONDepthError(f"nested deeper than {max_depth} levels")


def json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0, ``[]`` and ``{}`` are 1).

    Iterative, so any depth that Python could build is measured without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in v)
    return depth


def check_depth(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raises: JSONDepthError when ``value`` nests deeper than ``max_depth``."""
    if json_depth(value) > max_depth:
        raise _too_deep(max_depth)


def _guarded(parse, *args, max_depth: int):
    """``parse(*args)`` with its errors turned into :class:`JSONTextError` (RecursionError:
    :class:`JSONDepthError`)."""
    try:
        return parse(*args)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes
        raise JSONTextError(str(exc)) from None


_DECODER = json.JSONDecoder()


def loads(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` that raises only :class:`JSONTextError` (a ``ValueError``).

    Raises:
        JSONTextError: not JSON; its subclass JSONDepthError: nested deeper than
            ``max_depth`` arrays/objects (the decoder's own recursion limit included).
    """
    value = _guarded(json.loads, text, max_depth=max_depth)
    check_depth(value, max_depth)
    return value


def raw_decode(text: str, start: int, max_depth: int = MAX_JSON_DEPTH) -> tuple[Any, int]:
    """``json.JSONDecoder().raw_decode(text, start)`` with :func:`loads`'s errors."""
    value, end = _guarded(_DECODER.raw_decode, text, start, max_depth=max_depth)
    check_depth(value, max_depth)
    return value, end
