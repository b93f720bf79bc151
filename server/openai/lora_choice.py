"""Which LoRA adapter a generation request runs on: its ``model`` and SGLang's ``lora_path``.

``model`` names an adapter as vLLM does (``"sql"``) or as SGLang does (``"base:sql"``); the
base model's own name (served name or ``--model-path``), sglang-router's ``"unknown"`` and
``null`` mean the base (``adapter_of_model``). SGLang's ``lora_path`` field, despite its name,
is the adapter's NAME as loaded with ``--lora-paths name=path`` or ``/load_lora_adapter``
(``adapters_of_request``):

- a string: the adapter of every prompt of the request, as ``model: "<name>"``; a ``model``
  naming another adapter is a 400 naming ``lora_path``;
- a list (SGLang's form for a ``/v1/completions`` list of prompts): one entry per prompt, in
  order, its length the number of prompts (a single prompt: a list of one); a ``null``
  entry is "absent": that prompt runs on what ``model`` names (the base when it names no
  adapter). Each prompt of one request may run on a different adapter (each is its own
  engine request);
- ``null``: absent.

An unknown adapter name is the 404 of an unknown model, naming ``lora_path`` (code
``model_not_found``); a value of another type is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from server.http.errors import APIError, bad_request
from server.openai.extensions import ROUTER_NO_MODEL


def _q(name: str, most: int = 100) -> str:
    """``name`` for an error message, cut to ``most`` characters (a client's 100 kB name is
    not echoed back whole)."""
    return name if len(name) <= most else name[:most] + f"... ({len(name)} characters)"


def _also(adapters: Mapping[str, str]) -> str:
    return f" or one of its LoRA adapters: {', '.join(sorted(adapters))}" if adapters else ""


def adapter_of_model(model: str | None, base_names: Iterable[str | None],
                     served: str, adapters: Mapping[str, str]) -> str | None:
    """The adapter a body's ``model`` names, None for the base model.

    Args:
        model: the body's ``model`` (None: absent).
        base_names: the names of the base model (served name, ``--model-path``; None skipped).
        served: the served model name (quoted by the 404).
        adapters: the loaded adapters, name -> path.
    Raises:
        APIError: 404 naming ``model`` (code ``model_not_found``) when it names neither the
            base model nor a loaded adapter.
    """
    bases = [b for b in base_names if b]
    if model is None or model == ROUTER_NO_MODEL or model in bases:
        return None
    name = model
    for base in bases:
        if model.startswith(base + ":"):
            name = model[len(base) + 1:]
    if name in adapters:
        return name
    raise APIError(f"The model '{_q(model)}' does not exist (this server serves "
                   f"'{served}'{_also(adapters)})", 404, "model", "model_not_found")


def _named(value: Any, param: str, served: str, adapters: Mapping[str, str]) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request("lora_path must be an adapter's name (a non-empty string), a list "
                          "of them and nulls (one per prompt), or null", param)
    if value not in adapters:
        raise APIError(f"The LoRA adapter '{_q(value)}' does not exist (this server serves "
                       f"'{served}'{_also(adapters) or ' and no LoRA adapters'})", 404, param,
                       "model_not_found")
    return value


def adapters_of_request(model_adapter: str | None, lora_path: Any, served: str,
                        adapters: Mapping[str, str], prompts: int = 1) -> list[str | None]:
    """The adapter of each prompt of a request (None: the base model).

    Args:
        model_adapter: what the body's ``model`` names (``adapter_of_model``).
        lora_path: the body's ``lora_path`` as sent (None: absent).
        served: the served model name (quoted by the 404).
        adapters: the loaded adapters, name -> path.
        prompts: the request's prompts (1 for chat and Responses).
    Returns:
        ``prompts`` entries, each an adapter name or None.
    Raises:
        APIError: 400 naming ``lora_path`` (or ``lora_path[i]``) for a value of another
            type, a list whose length is not ``prompts``, or an adapter other than the one
            ``model`` names; 404 naming it for an adapter that is not loaded.
    """
    if lora_path is None:
        return [model_adapter] * prompts
    if isinstance(lora_path, list):
        if len(lora_path) != prompts:
            raise bad_request(f"lora_path has {len(lora_path)} entries but the request has "
                              f"{prompts} prompt{'s' if prompts != 1 else ''}: give one "
                              "adapter name (or null) per prompt, or a single name",
                              "lora_path")
        entries = [(f"lora_path[{i}]", v) for i, v in enumerate(lora_path)]
    else:
        entries = [("lora_path", lora_path)] * prompts
    out: list[str | None] = []
    for param, value in entries:
        if value is None:
            out.append(model_adapter)
            continue
        name = _named(value, param, served, adapters)
        if model_adapter is not None and name != model_adapter:
            raise bad_request(f"lora_path names the adapter '{name}' but model names "
                              f"'{model_adapter}': name one adapter (model or lora_path)",
                              param)
        out.append(name)
    return out


def fields_of(req: Any, prompts: int, n: int = 1) -> list[str | None]:
    """The body field that named the adapter of each engine request of a parsed request
    (``prompts`` x ``n``, prompt by prompt): ``"lora_path"`` or ``"lora_path[i]"``, None where
    ``model`` did (or nothing did). The engine's 404 for an adapter unloaded after the
    route's check names it (``TokenizerManager.generate``'s ``lora_param``)."""
    lora_path = (getattr(req, "model_extra", None) or {}).get("lora_path")
    if isinstance(lora_path, list):
        one = [f"lora_path[{i}]" if v is not None else None for i, v in enumerate(lora_path)]
    else:
        one = ["lora_path" if lora_path is not None else None] * prompts
    return [f for f in one for _ in range(n)]


def shown_model(loras: list[str | None], served: str) -> str:
    """The response's ``model``: the adapter when every prompt ran on the same one, else the
    served model name."""
    first = loras[0] if loras else None
    return first if first is not None and all(x == first for x in loras) else served
