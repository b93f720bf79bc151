"""The grammar constraints that the structured-output tests check and that
``ferry bench-grammar`` times the compile of: one definition for both.

``SCHEMAS``, ``REGEX`` and ``EBNF`` are tests/engine/test_grammar.py's; ``PERSON``,
``WEATHER`` and ``TIME_TZ`` (the parameters of its two tools) are
tests/e2e/test_structured_api.py's.
"""

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "colours": {"type": "array", "minItems": 2, "maxItems": 3,
                    "items": {"type": "string", "maxLength": 10}}},
        "required": ["colours"], "additionalProperties": False},
    "enum_bounds": {"type": "object", "properties": {
        "mood": {"enum": ["happy", "sad", "calm"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 10},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["mood", "score", "ratio"], "additionalProperties": False},
}
REGEX = r"(\d{3})-(\d{3})-(\d{4})"
EBNF = 'root ::= "The answer is " ("yes" | "no") "."'
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "minItems": 1, "maxItems": 3,
             "items": {"enum": ["a", "b", "c"]}}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_TZ = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}},
           "required": ["tz"]}
