"""Bounds of the bookkeeping fields a client may attach to a request, as OpenAI documents them.

``metadata``, ``user``, ``safety_identifier`` and ``prompt_cache_key`` change no output in
ferry (accepted no-ops), but the Responses API keeps ``metadata`` and ``user`` with a stored
response (``server/responses/store.py``) and echoes them, so without bounds a small request
could pin megabytes in the HTTP process for the store's TTL. OpenAI's bounds:

- ``metadata``: an object of at most ``MAX_METADATA_PAIRS`` (16) pairs; keys are strings of
  at most ``MAX_METADATA_KEY_LEN`` (64) characters, values strings of at most
  ``MAX_METADATA_VALUE_LEN`` (512);
- ``user``, ``safety_identifier``, ``prompt_cache_key``: strings of at most ``MAX_ID_LEN``
  (64) characters (OpenAI documents 64 for ``safety_identifier``; ferry holds the others,
  which it replaces, to the same bound);
- ``service_tier``, ``verbosity``, ``prompt_cache_retention``: one of OpenAI's values
  (``ENUM_FIELDS``).

A field outside them is a 400 naming it (``metadata.<key>`` for a value), in OpenAI's
wording ("Invalid 'user': string too long..."); ``null`` is absent. The same bounds hold on
``/v1/chat/completions``, ``/v1/completions`` (where the field exists) and
``/v1/responses``; ``json_schemas`` is their ``/openapi.json`` form.
"""

from __future__ import annotations

from typing import Any

from server.http.errors import APIError

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_LEN = 64
MAX_METADATA_VALUE_LEN = 512
MAX_ID_LEN = 64
#: the string fields bounded to MAX_ID_LEN characters
ID_FIELDS = ("user", "safety_identifier", "prompt_cache_key")
#: no-op fields with a closed set of values (OpenAI's): another value is a 400, as OpenAI
#: answers it, though ferry ignores the field
ENUM_FIELDS = {
    "service_tier": ("auto", "default", "flex", "scale", "priority"),
    "verbosity": ("low", "medium", "high"),
    "prompt_cache_retention": ("in-memory", "24h"),
}
#: every field this module bounds, in the order ``check_fields`` checks them
BOUNDED = ("metadata", *ID_FIELDS, *ENUM_FIELDS)


def _too_long(param: str, value: str, limit: int) -> APIError:
    return APIError(f"Invalid '{param}': string too long. Expected a string with maximum "
                    f"length {limit}, but got a string with length {len(value)} instead.",
                    400, param, "string_above_max_length")


def _not_string(param: str) -> APIError:
    return APIError(f"Invalid '{param}': expected a string.", 400, param, "invalid_type")


def check_metadata(value: Any) -> APIError | None:
    """The 400 of a ``metadata`` outside OpenAI's bounds (module docstring), or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return APIError("Invalid 'metadata': expected an object of string keys and string "
                        "values.", 400, "metadata", "invalid_type")
    if len(value) > MAX_METADATA_PAIRS:
        return APIError(f"Invalid 'metadata': too many properties. Expected an object with at "
                        f"most {MAX_METADATA_PAIRS} properties, but got an object with "
                        f"{len(value)} properties instead.", 400, "metadata",
                        "object_above_max_properties")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_LEN:  # the key is not echoed: it may be long
            return APIError(f"Invalid 'metadata': a key is too long. Expected keys with "
                            f"maximum length {MAX_METADATA_KEY_LEN}, but got a key with length "
                            f"{len(key)} instead.", 400, "metadata", "string_above_max_length")
        param = f"metadata.{key}"
        if not isinstance(item, str):
            return _not_string(param)
        if len(item) > MAX_METADATA_VALUE_LEN:
            return _too_long(param, item, MAX_METADATA_VALUE_LEN)
    return None


def check_field(name: str, value: Any) -> APIError | None:
    """The 400 of field ``name`` (one of ``BOUNDED``) outside its bounds, or None (also for
    ``null`` and for a field this module does not bound)."""
    if name == "metadata":
        return check_metadata(value)
    if name in ENUM_FIELDS and value is not None:
        allowed = ENUM_FIELDS[name]
        if value not in allowed:
            return APIError(f"Invalid value for '{name}': expected one of "
                            f"{', '.join(repr(v) for v in allowed)}, got {value!r}.", 400, name,
                            "invalid_value")
        return None
    if name not in ID_FIELDS or value is None:
        return None
    if not isinstance(value, str):
        return _not_string(name)
    if len(value) > MAX_ID_LEN:
        return _too_long(name, value, MAX_ID_LEN)
    return None


def check_fields(fields: dict[str, Any]) -> None:
    """Check every bounded field of ``fields`` (a request's fields, e.g. ``model_extra``).

    Raises: APIError 400 naming the first field outside its bounds."""
    for name in BOUNDED:
        err = check_field(name, fields.get(name))
        if err is not None:
            raise err


def json_schemas() -> dict[str, dict]:
    """The request-schema properties of these fields (``/openapi.json``); null is absent."""
    ident = {"anyOf": [{"type": "string", "maxLength": MAX_ID_LEN}, {"type": "null"}]}
    return {
        "metadata": {"anyOf": [{
            "type": "object", "maxProperties": MAX_METADATA_PAIRS,
            "propertyNames": {"maxLength": MAX_METADATA_KEY_LEN},
            "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_LEN}},
            {"type": "null"}],
            "description": f"at most {MAX_METADATA_PAIRS} pairs; keys of at most "
                           f"{MAX_METADATA_KEY_LEN} characters, string values of at most "
                           f"{MAX_METADATA_VALUE_LEN}; no effect"},
        **{name: dict(ident, description=f"at most {MAX_ID_LEN} characters; no effect")
           for name in ID_FIELDS},
        **{name: {"anyOf": [{"enum": list(values)}, {"type": "null"}],
                  "description": "no effect"} for name, values in ENUM_FIELDS.items()}}
