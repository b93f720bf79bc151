"""Issue 41 item 1: the bookkeeping fields a client attaches (``metadata``, ``user``,
``safety_identifier``, ``prompt_cache_key``) are bounded as OpenAI documents them (16 pairs,
keys of 64 characters, string values of 512; the ids 64 characters): at the bound served, one
past it a 400 naming the field, on /v1/responses (which keeps ``metadata`` and ``user`` with
a stored response), /v1/chat/completions and /v1/completions. The bounds are written out by
hand here (OpenAI's API reference), not read from the module.
"""

from __future__ import annotations

import httpx
import jsonschema
import pytest
from app_helpers import make_app

from server.http.errors import APIError
from server.openai.field_limits import json_schemas
from server.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from server.responses.request import parse_responses_request

ROUTES = ("chat", "completions", "responses")


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(None)  # the embedded SmolLM2's HF tokenizer


def _parse(route: str, **fields):
    if route == "chat":
        return parse_request(ChatCompletionRequest,
                             {"messages": [{"role": "user", "content": "hi"}], **fields})
    if route == "completions":
        return parse_request(CompletionRequest, {"prompt": "hi", **fields})
    return parse_responses_request({"input": "hi", **fields})


def _error(route: str, **fields) -> APIError:
    with pytest.raises(APIError) as ei:
        _parse(route, **fields)
    assert ei.value.status == 400 and ei.value.type == "invalid_request_error"
    return ei.value


def _pairs(n: int, key_len: int = 2, value_len: int = 1) -> dict[str, str]:
    return {f"{i:0{key_len}d}": "v" * value_len for i in range(n)}


@pytest.mark.parametrize("route", ROUTES)
def test_metadata_bounds(route):
    _parse(route, metadata=_pairs(16, key_len=64, value_len=512))  # all at the bound
    _parse(route, metadata={})
    _parse(route, metadata=None)
    err = _error(route, metadata=_pairs(17))
    assert (err.param, err.code) == ("metadata", "object_above_max_properties")
    assert "16" in err.message and "17" in err.message
    err = _error(route, metadata={"k" * 65: "v"})
    assert (err.param, err.code) == ("metadata", "string_above_max_length")
    assert "k" * 65 not in err.message  # a long key is not echoed
    err = _error(route, metadata={"k": "v" * 513})
    assert (err.param, err.code) == ("metadata.k", "string_above_max_length")
    assert "512" in err.message and "513" in err.message
    for bad in (5, "x", {"a": {"b": "c"}}, {"a": 1}, {"a": None}):
        assert _error(route, metadata=bad).code == "invalid_type", bad
    assert _error(route, metadata=["a"]).param == "metadata"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", ["user", "safety_identifier", "prompt_cache_key"])
def test_identifier_bounds(route, name):
    _parse(route, **{name: "u" * 64})
    _parse(route, **{name: None})
    err = _error(route, **{name: "u" * 65})
    assert (err.param, err.code) == (name, "string_above_max_length")
    assert "64" in err.message and "65" in err.message
    assert _error(route, **{name: 5}).param == name


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1})])
async def test_over_http_a_400_naming_the_field_and_nothing_generated(tok, path, body):
    app, engine = make_app()
    engine.tm.set_tokenizer(tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        for extra, param in (({"metadata": _pairs(17)}, "metadata"),
                             ({"metadata": {"k": "v" * 513}}, "metadata.k"),
                             ({"user": "u" * 65}, "user"),
                             ({"safety_identifier": "s" * 65}, "safety_identifier")):
            r = await c.post(path, json={**body, **extra})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["param"], err["type"]) == (param, "invalid_request_error"), err
        assert engine.rids == []
        ok = {**body, "metadata": _pairs(16, 64, 512), "user": "u" * 64}
        r = await c.post(path, json=ok)
        assert r.status_code == 200, r.text
        if path == "/v1/responses":  # echoed as sent
            assert r.json()["metadata"] == ok["metadata"] and r.json()["user"] == "u" * 64


def test_the_openapi_schemas_say_the_same():
    schemas = json_schemas()
    meta = jsonschema.Draft202012Validator(schemas["metadata"])
    assert meta.is_valid(_pairs(16, 64, 512)) and meta.is_valid(None)
    for bad in (_pairs(17), {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, "x"):
        assert not meta.is_valid(bad), bad
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        v = jsonschema.Draft202012Validator(schemas[name])
        assert v.is_valid("u" * 64) and v.is_valid(None)
        assert not v.is_valid("u" * 65) and not v.is_valid(5)


# OpenAI's values of the enumerated no-ops (its API reference, written out here)
_ENUMS = {"service_tier": ("auto", "default", "flex", "scale", "priority"),
          "verbosity": ("low", "medium", "high"),
          "prompt_cache_retention": ("in-memory", "24h")}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", sorted(_ENUMS))
def test_enumerated_noops_take_only_openais_values(route, name):
    if route == "responses" and name == "verbosity":
        return  # Responses has text.verbosity instead (server/responses/input.py)
    for value in (*_ENUMS[name], None):
        _parse(route, **{name: value})
    for bad in ("ultra", "LOW", 5, ""):
        err = _error(route, **{name: bad})
        assert (err.param, err.code) == (name, "invalid_value"), (name, bad)
    schema = jsonschema.Draft202012Validator(json_schemas()[name])
    assert all(schema.is_valid(v) for v in _ENUMS[name]) and not schema.is_valid("ultra")


def test_stream_obfuscation_is_an_accepted_noop_on_chat():
    req = parse_request(ChatCompletionRequest, {
        "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert req.include_usage
    with pytest.raises(APIError):
        parse_request(ChatCompletionRequest, {
            "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_obfuscation": "no"}})


def test_responses_text_verbosity_takes_only_openais_values():
    from server.responses.input import chat_response_format

    for value in _ENUMS["verbosity"]:
        assert chat_response_format({"verbosity": value}) is None
    with pytest.raises(APIError) as ei:
        chat_response_format({"verbosity": "loud"})
    assert (ei.value.status, ei.value.param) == (400, "text.verbosity")
