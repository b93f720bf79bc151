"""The field machinery of ``ServerArgs`` (``engine/args/__init__.py``) and its groups.

``flag`` declares a field with its CLI help, ``choices`` and bounds; ``field_error`` checks a
value against them; ``base_type`` is the type argparse converts to. A self-contained group
of flags (``engine/args/media.py``, ``lora.py``, ``speculative.py``) is a frozen dataclass of
its own; ``take_fields`` puts its fields into ``ServerArgs``, flat and in place, so the
flags, the keywords of ``ServerArgs(...)``/``LLM(...)`` and the attributes are the same as
if they were written in its body.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import field
from typing import Any


def flag(default: Any, help: str, choices: tuple | None = None, **kw) -> Any:
    """A field with its CLI help, its ``choices`` and further metadata in ``kw``: the bounds
    ``ge``, ``gt`` and ``le`` that ``ServerArgs.__post_init__`` checks."""
    md = {"help": help}
    if choices:
        md["choices"] = choices
    md.update(kw)
    return field(default=default, metadata=md)


def take_fields(*groups: type, before: str) -> Callable[[type], type]:
    """A class decorator (under ``@dataclass``): the fields of the ``groups`` dataclasses
    (annotations, defaults and metadata) go into the class's own, in that order, just
    before its field ``before``.

    Raises:
        ValueError: no field ``before`` in the class body, or a group field it declares too.
    """
    def wrap(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        if before not in own:
            raise ValueError(f"{cls.__name__} has no field {before!r} to put groups before")
        merged: dict[str, Any] = {}
        for name, annotation in own.items():
            if name == before:
                for group in groups:
                    for f in dataclasses.fields(group):
                        if f.name in own:
                            raise ValueError(f"{cls.__name__} declares {f.name!r} of "
                                             f"{group.__name__} again")
                        merged[f.name] = group.__annotations__[f.name]
                        setattr(cls, f.name, field(default=f.default, metadata=f.metadata))
            merged[name] = annotation
        cls.__annotations__ = merged
        return cls
    return wrap


#: bound key in a field's metadata -> (its sign in messages, the check)
_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le)}


def field_error(v: Any, md) -> str | None:
    """What is wrong with value ``v`` of a field with metadata ``md``, or None. Values in
    ``md["allow"]`` (value -> meaning) pass whatever the bounds; the bound message names
    them."""
    if "choices" in md and v not in md["choices"]:
        return "must be one of " + ", ".join(map(repr, md["choices"]))
    allow = md.get("allow", {})
    if allow and not isinstance(v, bool) and v in allow:
        return None
    error = _bound_error(v, md)
    if error and allow and error != "must be a number":
        error += " (or " + ", ".join(f"{k}: {m}" for k, m in allow.items()) + ")"
    return error


def _bound_error(v: Any, md) -> str | None:
    bounds = [k for k in _BOUNDS if k in md]
    if not bounds:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "must be a number"
    failed = [k for k in bounds if not _BOUNDS[k][1](v, md[k])]  # NaN fails every bound
    if not failed:
        return None
    lo = "ge" if "ge" in md else "gt" if "gt" in md else None
    if lo and "le" in md:
        return f"must be in {'[' if lo == 'ge' else '('}{md[lo]}, {md['le']}]"
    return f"must be {_BOUNDS[failed[0]][0]} {md[failed[0]]}"


def base_type(typ) -> type:
    """``typ`` without ``None`` (``int | None`` -> ``int``)."""
    args = getattr(typ, "__args__", None)
    if args:
        non_none = [a for a in args if a is not type(None)]
        return non_none[0]
    return typ
