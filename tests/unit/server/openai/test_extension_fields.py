"""Issue 27, item 1: SGLang's and vLLM's request fields (``EXTENSION_FIELDS``), as the routers
in front of them forward them. Each field at each value the table accepts is served on
/v1/chat/completions, /v1/completions and /v1/responses; any other value is a 400 naming it;
the routers' real bodies (captured from sglang-router 0.3.2 and vllm-router 0.1.17) are
served; the aliases (``sampling_seed``, ``rid``, ``request_id``) do what their peers' do; and
docs/usage.md's table is the table's. Over a fake engine."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from app_helpers import make_app

from server.http.errors import APIError
from server.openai.extensions import (
    ALIASES,
    EXTENSION_FIELDS,
    check_extension,
    markdown_table,
)
from server.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from server.responses.request import parse_responses_request

ROOT = Path(__file__).resolve().parents[4]
MESSAGES = [{"role": "user", "content": "hi"}]
#: what sglang-router 0.3.2 forwarded to a worker for a plain request (captured: a fake
#: worker logged the bodies; client bodies were {"messages"}, {"prompt"}, {"input"})
SGLANG_ROUTER_CHAT = {"continue_final_message": False, "ignore_eos": False, "logprobs": False,
                      "messages": MESSAGES, "model": "m", "no_stop_trim": False,
                      "return_hidden_states": False, "separate_reasoning": True,
                      "skip_special_tokens": True, "stream": False, "stream_reasoning": True}
SGLANG_ROUTER_COMPLETION = {"echo": False, "ignore_eos": False, "model": "m",
                            "no_stop_trim": False, "prompt": "hi",
                            "return_hidden_states": False, "skip_special_tokens": True,
                            "stream": False}
SGLANG_ROUTER_RESPONSES = {"input": "hi", "min_p": 0.0, "model": "m", "priority": 0,
                           "repetition_penalty": 1.0, "store": True, "stream": None,
                           "temperature": 1.0, "top_k": -1, "top_p": 1.0}
#: vllm-router 0.1.17 adds vLLM's include_reasoning to sglang-router's chat body
VLLM_ROUTER_CHAT = dict(SGLANG_ROUTER_CHAT, include_reasoning=True)


def other_value(accepted: tuple):
    """A value the table does not accept for a field whose accepted values are ``accepted``."""
    first = accepted[0]
    if isinstance(first, bool):
        return not first
    if first is None:
        return "x"
    if isinstance(first, int | float):
        return first + 1
    if isinstance(first, list):
        return ["x"]
    raise AssertionError(accepted)


def _parse(route: str, **fields):
    if route == "chat":
        return parse_request(ChatCompletionRequest, {"messages": MESSAGES, **fields})
    if route == "completions":
        return parse_request(CompletionRequest, {"prompt": "hi", **fields})
    return parse_responses_request({"input": "hi", **fields})


ROUTES = ("chat", "completions", "responses")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", sorted(EXTENSION_FIELDS))
def test_each_field_is_a_noop_at_its_accepted_values_and_a_400_otherwise(name, route):
    ext = EXTENSION_FIELDS[name]
    for value in ext.accepted:
        _parse(route, **{name: value})  # served
    refused = [other_value(ext.accepted)] if len(ext.accepted) == 1 else ["yes", 2]
    for value in refused:
        with pytest.raises(APIError) as ei:
            _parse(route, **{name: value})
        err = ei.value
        assert (err.status, err.param, err.code) == (400, name, "unsupported_parameter"), err
        assert name in err.message and "ferry accepts only" in err.message
        if ext.lacks:
            assert ext.lacks in err.message


def test_json_equality_keeps_booleans_apart():
    assert check_extension("priority", 0) is None and check_extension("priority", 0.0) is None
    assert check_extension("priority", False) is not None  # false is not 0 in JSON
    assert check_extension("return_hidden_states", 0) is not None
    assert check_extension("length_penalty", 1) is None
    assert check_extension("not_in_the_table", 5) is None  # the caller refuses it


@pytest.mark.parametrize("body", [SGLANG_ROUTER_CHAT, VLLM_ROUTER_CHAT])
def test_the_routers_chat_body_is_served(body):
    req = parse_request(ChatCompletionRequest, body)
    assert req.messages[0].content == "hi"


def test_the_routers_completion_and_responses_bodies_are_served():
    parse_request(CompletionRequest, SGLANG_ROUTER_COMPLETION)
    req = parse_responses_request(SGLANG_ROUTER_RESPONSES)
    assert req.store is True  # the response is stored (tests/unit/server/responses/test_responses_store.py)


def test_unknown_fields_are_still_refused_by_name():
    for route in ROUTES:
        with pytest.raises(APIError) as ei:
            _parse(route, frobnicate=1)
        assert (ei.value.param, ei.value.code) == ("frobnicate", "unrecognized_field")


def test_sampling_seed_is_seed():
    req = parse_request(CompletionRequest, {"prompt": "hi", "sampling_seed": 7})
    assert req.seed == 7 and req.sampling_params(4).seed == 7
    assert "sampling_seed" not in (req.model_extra or {})
    assert parse_request(CompletionRequest, {"prompt": "hi", "sampling_seed": 7,
                                             "seed": 7}).seed == 7
    for bad in ({"seed": 8}, {"sampling_seed": "7"}, {"sampling_seed": True},
                {"sampling_seed": 2**63}):
        with pytest.raises(APIError) as ei:
            parse_request(ChatCompletionRequest, {"messages": MESSAGES, "sampling_seed": 7,
                                                  **bad})
        assert ei.value.param == "sampling_seed", bad


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


@pytest.fixture
def app(tok):
    app, engine = make_app()
    engine.tm.set_tokenizer(tok)
    return app, engine


async def _post(app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app[0]),
                                 base_url="http://t") as c:
        return await c.post(path, json=body, headers=headers or {})


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1})])
@pytest.mark.parametrize("field", ["rid", "request_id"])
async def test_rid_and_request_id_name_the_request(app, path, body, field):
    def body_id(r: httpx.Response, client_id: str) -> None:
        if path == "/v1/responses":  # a stored response's id is server-made (issue 41)
            assert re.fullmatch(r"resp_[0-9a-f]{48}", r.json()["id"]), r.json()["id"]
        else:
            assert r.json()["id"] == client_id

    r = await _post(app, path, {**body, field: "my-id-1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "my-id-1"
    body_id(r, "my-id-1")
    assert app[1].rids[-1] == "my-id-1"  # the engine's request id too
    # the header and the body naming the same id is fine; different ids are a 400
    r = await _post(app, path, {**body, field: "my-id-2"}, {"X-Request-Id": "my-id-2"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-2"
    body_id(r, "my-id-2")
    r = await _post(app, path, {**body, field: "my-id-3"}, {"X-Request-Id": "other"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    for bad in ("has space", "", 5, ["a", "b"], "x" * 257):
        r = await _post(app, path, {**body, field: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, bad
    r = await _post(app, path, {**body, "rid": "a1", "request_id": "b1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


async def test_the_routers_bodies_through_the_app(app):
    """The issue's failure: every chat body through sglang-router was a 400 naming
    separate_reasoning, every completion one naming return_hidden_states."""
    for path, body in (("/v1/chat/completions", SGLANG_ROUTER_CHAT),
                       ("/v1/chat/completions", VLLM_ROUTER_CHAT),
                       ("/v1/completions", SGLANG_ROUTER_COMPLETION),
                       ("/v1/responses", SGLANG_ROUTER_RESPONSES)):
        r = await _post(app, path, dict(body, model=None, max_tokens=1)
                        if "responses" not in path else dict(body, model=None))
        assert r.status_code == 200, (path, r.text)
        if "responses" in path:
            assert r.json()["store"] is True  # stored, as OpenAI's default


def test_docs_table_is_the_table():
    usage = (ROOT / "docs" / "usage.md").read_text()
    assert markdown_table() in usage, (
        "docs/usage.md's table of SGLang's and vLLM's fields differs from "
        "server/openai/extensions.py; paste `python -m server.openai.extensions`")
    for name in (*EXTENSION_FIELDS, *ALIASES):
        assert f"`{name}`" in usage


async def test_openapi_documents_every_field(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app[0]),
                                 base_url="http://t") as c:
        doc = (await c.get("/openapi.json")).json()
    for schema in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][schema]["properties"]
        assert set(EXTENSION_FIELDS) | set(ALIASES) <= set(props)
        assert props["separate_reasoning"]["anyOf"][0] == {"enum": [True, False]}
        assert props["lora_id"]["anyOf"] == [{"type": "null"}]
        assert {"type": "string", "minLength": 1} in props["lora_path"]["anyOf"]
