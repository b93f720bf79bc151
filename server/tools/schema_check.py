"""The shape of a tool's ``parameters`` schema, checked before anything reads it.

A chat template walks a tool's schema (gpt-oss's renders ``properties`` as a TypeScript
type, others print ``type``, ``enum``, ``required``), so a schema of the wrong shape would
fail inside the template, whose error can only name ``messages``. ``check_schema_shape``
finds such a schema first and says where: the keywords that hold subschemas must hold
schemas (objects or booleans), ``properties``/``$defs`` objects of them, ``required`` and
``enum`` lists, ``type`` one of JSON Schema's type names or a list of them. It is a shape
check, not a validator: the keywords it does not know are left alone (xgrammar decides
those where the schema is enforced: ``server/tools/plan.py``).
"""

from __future__ import annotations

from typing import Any

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
#: keywords whose value is one subschema
ONE = ("items", "additionalProperties", "not", "contains", "propertyNames",
       "additionalItems", "unevaluatedProperties", "unevaluatedItems", "if", "then", "else")
#: keywords whose value is a list of subschemas
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
#: keywords whose value is an object of subschemas
MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaShapeError(ValueError):
    """A schema of the wrong shape: ``path`` (``properties.a.type``) and what it must be."""

    def __init__(self, path: str, expected: str):
        super().__init__(f"{path or 'the schema'}: expected {expected}")
        self.path, self.expected = path, expected


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def check_schema_shape(schema: Any, path: str = "") -> None:
    """Check ``schema`` (a decoded JSON schema, nesting already bounded) recursively.

    Raises:
        SchemaShapeError: the first keyword of the wrong shape.
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise SchemaShapeError(path, "a schema (an object or a boolean)")
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
            raise SchemaShapeError(_join(path, "type"), "one of " + ", ".join(sorted(TYPES))
                                   + " (or a list of them)")
    for key in ("required", "enum"):
        value = schema.get(key)
        if value is not None and not isinstance(value, list):
            raise SchemaShapeError(_join(path, key), "a list")
    required = schema.get("required") or []
    if not all(isinstance(r, str) for r in required):
        raise SchemaShapeError(_join(path, "required"), "a list of property names")
    for key in ONE:
        if key in schema:
            value = schema[key]
            if key in ("items", "additionalItems") and isinstance(value, list):
                for j, sub in enumerate(value):  # draft 4-7 tuple form
                    check_schema_shape(sub, f"{_join(path, key)}[{j}]")
            else:
                check_schema_shape(value, _join(path, key))
    for key in MANY:
        if key in schema:
            if not isinstance(schema[key], list):
                raise SchemaShapeError(_join(path, key), "a list of schemas")
            for j, sub in enumerate(schema[key]):
                check_schema_shape(sub, f"{_join(path, key)}[{j}]")
    for key in MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                raise SchemaShapeError(_join(path, key), "an object of schemas")
            for name, sub in schema[key].items():
                check_schema_shape(sub, f"{_join(path, key)}.{name}")
