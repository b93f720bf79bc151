"""LoRA adapter endpoints: ``POST /load_lora_adapter`` and ``/unload_lora_adapter`` (SGLang's
paths; also at vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``), and the
``/v1/models`` cards of the loaded adapters.

Bodies (both projects' form): ``{"lora_name": "sql", "lora_path": "/adapters/sql"}`` to load,
``{"lora_name": "sql"}`` to unload. The answer is ``{"success": true, "message": ...,
"loaded_adapters": {name: path}}``; a bad body, path, format or rank is a 400 naming the
field (a name that names the base model too: its served name, ``--model-path`` or
sglang-router's ``unknown``; a name over 256 characters or with characters outside
``engine.args.ADAPTER_NAME_CHARS``), an unknown name a 404, a server started without ``--enable-lora`` / ``--lora-paths``
a 400. Requests already running on an unloaded adapter finish on it.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.args import adapter_name_error
from server.http.body import read_json
from server.http.errors import APIError, bad_request
from server.openai.extensions import ROUTER_NO_MODEL

_FIELDS = {"load": ("lora_name", "lora_path"), "unload": ("lora_name",)}


def _body_fields(body: Any, kind: str) -> dict[str, str]:
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    allowed = _FIELDS[kind]
    for key in body:
        if key not in allowed:
            raise bad_request(f"unknown field '{key}' ({kind} takes {', '.join(allowed)})", key)
    out = {}
    for key in allowed:
        v = body.get(key)
        if not isinstance(v, str) or not v.strip():
            raise bad_request(f"'{key}' must be a non-empty string", key)
        out[key] = v
    return out


def base_names(args, served: str) -> tuple[str, ...]:
    """Names that pick the base model as a body's ``model`` (an adapter may not take them)."""
    return tuple(n for n in (served, args.model_path, ROUTER_NO_MODEL) if n)


def check_adapter_names(args, served: str) -> None:
    """``--lora-paths`` names against the base model's (``base_names``; ``served``: the
    served model name, ``server.app.model_name_of``), before start-up.

    Raises:
        ValueError: naming --lora-paths and the name.
    """
    from engine.args import lora_path_items

    taken = base_names(args, served)
    for name, _ in lora_path_items(args.lora_paths or []):
        if name in taken:
            raise ValueError(f"--lora-paths: the adapter name '{name}' names the base model "
                             f"(model: '{name}' picks the base model): choose another name")


async def change_adapter(serving, request: Request, kind: str) -> Response:
    """``kind`` "load" or "unload" an adapter in every engine replica."""
    body = await read_json(request, serving.args.max_request_bytes,
                           serving.args.body_read_timeout)
    fields = _body_fields(body, kind)
    tm = serving.tm
    if not tm.lora_enabled:
        raise bad_request("this server serves no LoRA adapters: start it with --enable-lora "
                          "(or --lora-paths)", "lora_name")
    name = fields["lora_name"]
    if kind == "load" and (bad := adapter_name_error(name)) is not None:
        raise bad_request(bad, "lora_name")
    if kind == "load" and name in base_names(serving.args, serving.model_name):
        # model (and the response's model) would name the base model, lora_path the adapter
        raise bad_request(f"the adapter name '{name}' names the base model (model: "
                          f"'{name}' picks the base model): choose another name", "lora_name")
    out = await tm.change_lora(name, fields.get("lora_path"))
    if not out.success:
        raise APIError(out.message, out.status, out.param,
                       "model_not_found" if out.status == 404 else None)
    return JSONResponse({"success": True, "message": out.message,
                         "loaded_adapters": tm.lora_adapters})


def adapter_cards(tm, base: str, created: int) -> list[dict]:
    """``/v1/models`` entries of the loaded adapters (``parent``: the base model, as vLLM)."""
    return [{"id": name, "object": "model", "created": created, "owned_by": "ferry",
             "root": path, "parent": base} for name, path in sorted(tm.lora_adapters.items())]
