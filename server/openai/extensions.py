"""SGLang's and vLLM's request fields that ferry does not implement, and what it does with each.

The routers in front of SGLang and vLLM (sglang-router, vllm-router: Rust binaries that parse a
body into SGLang's request structs and write it out again) add several of these fields to every
body they forward, at their defaults: a chat request arrives with ``separate_reasoning: true``,
``stream_reasoning: true``, ``return_hidden_states: false``, ``no_stop_trim: false`` (and
vllm-router's ``include_reasoning: true``), a completion with ``return_hidden_states: false``,
a Responses request with ``priority: 0``. Clients written for SGLang or vLLM send them too.

``EXTENSION_FIELDS`` is the one table of them: a field at a value it lists is accepted (a
no-op at its default; both booleans where ferry's output is what either asks for, or where
ferry implements both: the reasoning fields with ``--reasoning-parser``,
``server/pipeline/reasoning.py``), any other
value is a 400 naming the field (code ``unsupported_parameter``) that says what ferry lacks.
``null`` is "absent" everywhere (``server/openai/protocol_base.py``). The table holds for
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``; docs/usage.md's table
of these fields is ``markdown_table()`` (a test compares the two).

A few peer fields are implemented instead, as aliases of ferry's own: ``sampling_seed``
(SGLang) is ``seed``; ``rid`` (SGLang) and ``request_id`` (vLLM) name the request like the
``X-Request-Id`` header (``body_request_id``); SGLang's ``lora_path`` names the LoRA
adapter like ``model`` (``ROUTE_FIELDS``, ``server/openai/lora_choice.py``). sglang-router writes ``"model": "unknown"``
into a body that names no model; ferry takes it as absent (``ROUTER_NO_MODEL``).
``python -m server.openai.extensions`` prints the docs table.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from server.http import request_id
from server.http.errors import APIError, bad_request, not_supported
from server.http.request_id import MAX_REQUEST_ID_LEN

#: the ``model`` sglang-router writes into a body that names none: ferry takes it as absent
ROUTER_NO_MODEL = "unknown"
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_LEN}}}")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Extension:
    """One peer field: ``accepted`` values (the default first) are no-ops; ``origin`` says
    whose field it is; ``lacks`` is what ferry has not got (the 400's reason for any other
    value); ``note`` says why an accepted non-default value is still what the client gets."""

    accepted: tuple
    origin: str
    lacks: str
    note: str = ""


_REASONING = {
    "separate_reasoning": "implemented with --reasoning-parser: false leaves the reasoning "
                          "in the content as written; without a parser a no-op",
    "stream_reasoning": "implemented with --reasoning-parser: false sends the streamed "
                        "reasoning_content in one piece once the reasoning ends; without a "
                        "parser a no-op",
    "include_reasoning": "implemented with --reasoning-parser: false drops the reasoning "
                         "(reasoning_tokens still counts it); without a parser a no-op",
}
_PD = "prefill-decode disaggregation"
_DP = "choosing a data-parallel rank (one engine per server)"
_MM = "image, audio and video input"
_S, _V, _SV = "SGLang", "vLLM", "SGLang, vLLM"

#: field -> the values accepted as no-ops and why others are refused (module docstring)
EXTENSION_FIELDS: dict[str, Extension] = {
    # sent by sglang-router 0.3.2 and vllm-router 0.1.17 on every chat / completion body
    "separate_reasoning": Extension((True, False), _S, "", _REASONING["separate_reasoning"]),
    "stream_reasoning": Extension((True, False), _S, "", _REASONING["stream_reasoning"]),
    "include_reasoning": Extension((True, False), _V, "", _REASONING["include_reasoning"]),
    "return_hidden_states": Extension((False,), _S, "returning hidden states"),
    "no_stop_trim": Extension((False,), _S, "keeping the stop string (the text always ends "
                                            "before it)"),
    # SGLang
    "lora_id": Extension((None,), _S, "SGLang's internal adapter ids (name the adapter with "
                                      "`model` or `lora_path`)"),
    "session_params": Extension((None,), _S, "SGLang sessions"),
    "bootstrap_host": Extension((None,), _S, _PD),
    "bootstrap_port": Extension((None,), _S, _PD),
    "bootstrap_room": Extension((None,), _S, _PD),
    "bootstrap_pair_key": Extension((None,), _S, _PD),
    "data_parallel_rank": Extension((None,), _S, _DP),
    "routed_dp_rank": Extension((None,), _S, _DP),
    "disagg_prefill_dp_rank": Extension((None,), _S, _PD),
    "custom_logit_processor": Extension((None,), _S, "custom logit processors"),
    "custom_params": Extension((None,), _S, "custom logit processors"),
    "return_routed_experts": Extension((False,), _S, "returning MoE routing decisions"),
    "routed_experts_start_len": Extension((0,), _S, "returning MoE routing decisions"),
    "return_cached_tokens_details": Extension(
        (False,), _S, "per-tier cache details (usage.prompt_tokens_details.cached_tokens is "
                      "always there)"),
    "return_prompt_token_ids": Extension((False,), _S, "token ids in the response"),
    "return_meta_info": Extension((False,), _S, "SGLang's meta_info in the response"),
    "return_text_in_logprobs": Extension(
        (False, True), _S, "", "the logprobs of the OpenAI routes always carry token text"),
    "input_ids": Extension((None,), _S, "pre-tokenized chat prompts (/v1/completions takes "
                                        "token ids)"),
    "task": Extension((None,), _S, "DeepSeek-V4 task tokens"),
    "extra_key": Extension((None,), _S, "prefix-cache namespaces"),
    "ngram_corpus_id": Extension((None,), _S, "n-gram speculative decoding corpora"),
    "custom_labels": Extension((None,), _S, "custom metric labels"),
    "max_dynamic_patch": Extension((None,), _S, _MM),
    "min_dynamic_patch": Extension((None,), _S, _MM),
    "use_audio_in_video": Extension((False,), _S, _MM),
    "images_config": Extension((None,), _S, _MM),
    # both
    "priority": Extension((0,), _SV, "priority scheduling (requests run first come, first "
                                     "served)"),
    "session_id": Extension((None,), _SV, "sessions"),
    "cache_salt": Extension((None,), _SV, "prefix-cache salts"),
    # vLLM
    "use_beam_search": Extension((False,), _V, "beam search"),
    "length_penalty": Extension((1.0,), _V, "beam search"),
    "include_stop_str_in_output": Extension((False,), _V, "keeping the stop string (the text "
                                                          "always ends before it)"),
    "documents": Extension((None,), _V, "RAG documents for the chat template"),
    "chat_template": Extension((None,), _V, "per-request chat templates (the server's is "
                                            "fixed)"),
    "allowed_token_ids": Extension((None,), _V, "allowed-token lists (logit_bias bans or "
                                                "forces tokens)"),
    "bad_words": Extension(([],), _V, "banned words (logit_bias bans tokens)"),
    "logprob_token_ids": Extension((None,), _V, "logprobs of chosen token ids"),
    "watermarking": Extension((None,), _V, "watermarking"),
    "media_io_kwargs": Extension((None,), _V, _MM),
    "mm_processor_kwargs": Extension((None,), _V, _MM),
    "prompt_embeds": Extension((None,), _V, "prompt embeddings"),
    "kv_transfer_params": Extension((None,), _V, _PD),
    "ec_transfer_params": Extension((None,), _V, _PD),
    "vllm_xargs": Extension((None,), _V, "vLLM's extension arguments"),
    "logits_processors": Extension((None,), _V, "custom logit processors"),
    "repetition_detection": Extension((None,), _V, "repetition detection"),
    "stream_interval": Extension((None,), _V, "batching streamed tokens"),
    "thinking_token_budget": Extension((None,), _V, "thinking budgets"),
    "routed_experts_prompt_start": Extension((0,), _V, "returning MoE routing decisions"),
    "return_token_offsets": Extension((False,), _V, "token offsets (vLLM's render routes)"),
    "return_prompt_text": Extension((False,), _V, "the rendered prompt in the response"),
    "return_mm_kwargs": Extension((True,), _V, "vLLM's render routes"),
}

#: peer fields implemented as request fields (docs table rows); /v1/responses passes the
#: sampling ones on (``stop_regex``) and takes the others at their defaults only
#: (``chat_only_error``)
IMPLEMENTED = {
    "return_token_ids": (_SV, "`prompt_token_ids` (chat: the body's top level; completions: "
                              "each choice) and each choice's `token_ids` (EOS or stop token "
                              "included), streamed with their chunks (vLLM's placement)"),
    "truncate_prompt_tokens": (_V, "keep at most this many prompt tokens (`-1`: the "
                                   "context length; `0` is a 400), cut on `truncation_side`"),
    "truncation_side": (_V, "`left` (the default: keep the prompt's last tokens) or `right` "
                            "(keep its first ones); the kept ids are what `return_token_ids` "
                            "shows"),
    "stop_regex": (_S, "a pattern or a list (at most 16, 256 characters each; not with "
                       "`min_tokens`): the text ends before the first match, `matched_stop` "
                       "names the pattern; a stream holds back a tail that could still grow "
                       "into a match"),
}

#: peer fields every generation route (chat, completions, Responses) reads from the body itself
#: (docs table rows): ``server/openai/lora_choice.py``
ROUTE_FIELDS = {
    "lora_path": (_S, "the LoRA adapter by name (as loaded with `--lora-paths name=path`), as "
                      "`model: \"name\"`: a string for the whole request, or a list "
                      "of one name or null per prompt (null: what `model` names; several "
                      "prompts on /v1/completions may each have their own); an adapter other than the one `model` names is a 400, "
                      "an unknown one a 404, both naming `lora_path`"),
}

#: peer fields implemented as aliases of ferry's own (docs table rows; see the module docstring)
ALIASES = {
    "sampling_seed": (_S, "`seed` (a 400 if both are set and differ)"),
    "rid": (_S, "the `X-Request-Id` header: the response's `id` (not on /v1/responses, whose "
                "ids are the server's) and the engine's request id (a 400 if they differ)"),
    "request_id": (_V, "as `rid`"),
}


def chat_only_error(name: str, value: Any) -> APIError | None:
    """The 400 of an ``IMPLEMENTED`` field that ``/v1/responses`` got at a value other than
    its default (``null`` and ``false`` pass), else None."""
    if value is None or value is False:
        return None
    return not_supported(name, "only on /v1/chat/completions and /v1/completions")


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, ``1`` is ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _shown(values: tuple) -> str:
    return " or ".join(json.dumps(v) for v in values)


def check_extension(name: str, value: Any) -> APIError | None:
    """None if ``name`` is not in the table or ``value`` is one it accepts; else the 400
    naming the field (``null`` never gets here: it means absent)."""
    ext = EXTENSION_FIELDS.get(name)
    if ext is None or value is None or any(_same(value, a) for a in ext.accepted):
        return None
    accepted = [a for a in ext.accepted if a is not None]
    tail = f"ferry accepts only {_shown(tuple(accepted))}" if accepted else \
        "ferry accepts only null"
    return not_supported(name, f"{ext.lacks or 'this value'} ({tail})")


def apply_aliases(body: dict) -> dict:
    """``body`` with SGLang's ``sampling_seed`` moved to ``seed``.

    Raises:
        APIError: 400 naming ``sampling_seed`` when it is not an int64, or differs from a
            ``seed`` also given.
    """
    value = body.get("sampling_seed")
    if value is None:
        return body
    if isinstance(value, bool) or not isinstance(value, int) or \
            not INT64_MIN <= value <= INT64_MAX:
        raise bad_request("sampling_seed must be an integer in [-2**63, 2**63)",
                          "sampling_seed")
    seed = body.get("seed")
    if seed is not None and not _same(seed, value):
        raise bad_request("sampling_seed and seed differ (sampling_seed is SGLang's name of "
                          "seed)", "sampling_seed")
    out = {k: v for k, v in body.items() if k != "sampling_seed"}
    out["seed"] = value
    return out


def body_request_id(extra: dict) -> tuple[str, str] | None:
    """``(field, id)`` of SGLang's ``rid`` or vLLM's ``request_id`` in a request's extra
    fields, or None.

    Raises:
        APIError: 400 naming the field when it is not 1 to MAX_REQUEST_ID_LEN printable ASCII
            characters (the rule of the ``X-Request-Id`` header), or when both are set and
            differ.
    """
    found = None
    for name in ("rid", "request_id"):
        value = extra.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not _REQUEST_ID.fullmatch(value):
            raise bad_request(f"{name} must be a string of 1 to {MAX_REQUEST_ID_LEN} "
                              "printable ASCII characters without spaces", name)
        if found is not None and found[1] != value:
            raise bad_request("rid and request_id differ", name)
        found = found or (name, value)
    return found


def adopt_body_id(request, extra: dict | None, rid: str) -> str:
    """The id of a generation request: the body's ``rid``/``request_id`` when it has one
    (then also the ``X-Request-Id`` of the response), else ``rid`` (the header's or a new
    one). Raises: APIError 400 naming the field (``body_request_id``, ``request_id.adopt``)."""
    found = body_request_id(extra or {})
    return request_id.adopt(request, found[1], found[0]) if found else rid


def json_schemas() -> dict[str, dict]:
    """The request-schema properties of these fields (``/openapi.json``): the accepted values
    of each (``null``: absent), and the aliases' types."""
    out: dict[str, dict] = {
        "sampling_seed": {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX,
                          "description": "SGLang's name of seed"},
        **{name: {"type": "string", "pattern": _REQUEST_ID.pattern.join("^$"),
                  "description": "the request's id, as the X-Request-Id header"}
           for name in ("rid", "request_id")},
        "lora_path": {"anyOf": [{"type": "string", "minLength": 1}, {
            "type": "array", "items": {"anyOf": [{"type": "string", "minLength": 1},
                                                 {"type": "null"}]}}, {"type": "null"}],
                      "description": "SGLang's: the LoRA adapter's name (one per prompt)"}}
    for name, ext in EXTENSION_FIELDS.items():
        values = [v for v in ext.accepted if v is not None]
        out[name] = {"anyOf": [{"enum": values}, {"type": "null"}] if values else
                     [{"type": "null"}],
                     "description": f"{ext.origin}'s; " + (
                         f"any other value is a 400 ({ext.lacks})" if ext.lacks
                         else ext.note)}
    return out


def markdown_table() -> str:
    """docs/usage.md's table of these fields (``IMPLEMENTED``, ``ROUTE_FIELDS``, ``ALIASES``
    and ``EXTENSION_FIELDS``)."""
    rows = ["| field | from | ferry |", "|---|---|---|"]
    for name, (origin, what) in {**IMPLEMENTED, **ROUTE_FIELDS, **ALIASES}.items():
        rows.append(f"| `{name}` | {origin} | implemented: {what} |")
    for name, ext in EXTENSION_FIELDS.items():
        values = ", ".join(f"`{json.dumps(v)}`" for v in ext.accepted)
        if ext.lacks:
            rows.append(f"| `{name}` | {ext.origin} | no-op at {values}; any other value is "
                        f"a 400: {ext.lacks} |")
        elif ext.note.startswith("implemented"):
            rows.append(f"| `{name}` | {ext.origin} | {ext.note} (accepted: {values}) |")
        else:
            rows.append(f"| `{name}` | {ext.origin} | no-op at {values}: {ext.note} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
