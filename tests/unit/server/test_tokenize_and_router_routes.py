"""Issue 27, items 2 and 3. ``/v1/tokenize`` with ``messages`` counts exactly the prompt a chat
request with the same fields runs (``continue_final_message``, ``add_generation_prompt``,
``chat_template_kwargs``, ``tools``: it ignored ``continue_final_message``); every tokenizer
route answers an unknown field with a 400 naming it (``{"frobnicate": 1}`` got a 200); and the
routes SGLang's routers ask (``/model_info``, ``/get_model_info``, ``/get_server_info``,
``/health_generate``, ``/get_load``) answer in SGLang's shape. Over a fake engine with the
embedded model's real tokenizer."""

from __future__ import annotations

import httpx
import pytest
from app_helpers import make_app

CONTINUE = [{"role": "user", "content": "List three colours."},
            {"role": "assistant", "content": "1. Red\n2."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


@pytest.fixture
def app(tok):
    app, engine = make_app(model_path=None, served_model_name=None)
    engine.tm.set_tokenizer(tok)
    return app, engine


async def _call(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app[0]),
                                 base_url="http://t") as c:
        return await c.request(method, path, json=body)


async def _chat_prompt_ids(app, **fields) -> list[int]:
    r = await _call(app, "POST", "/v1/chat/completions", {"max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    return app[1].sent[-1].input_ids


async def _tokens(app, path: str = "/v1/tokenize", **fields) -> list[int]:
    r = await _call(app, "POST", path, fields)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"])
    return body["tokens"]


@pytest.mark.parametrize("fields", [
    {"messages": CONTINUE, "continue_final_message": True, "add_generation_prompt": False},
    {"messages": CONTINUE, "continue_final_message": True},  # SGLang's: no generation prompt
    {"messages": CONTINUE[:1]},
    {"messages": CONTINUE[:1], "add_generation_prompt": False},
    {"messages": CONTINUE[:1], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": CONTINUE[:1], "tools": TOOLS},
    {"messages": CONTINUE[:1], "add_special_tokens": True},
    {"messages": CONTINUE[:1], "reasoning_effort": "low",
     "chat_template_kwargs": {"enable_thinking": False}},
], ids=["continue", "continue-sglang", "plain", "no-generation-prompt", "template-kwargs", "tools",
        "special", "reasoning-effort"])
async def test_tokenize_counts_the_prompt_chat_runs(app, tok, fields):
    for path in ("/v1/tokenize", "/tokenize"):
        assert await _tokens(app, path, **fields) == await _chat_prompt_ids(app, **fields)


async def test_reasoning_effort_is_one_of_openais_values(app, tok):
    """Chat and /v1/tokenize take OpenAI's reasoning_effort values; another is a 400 naming
    it, and with a plain prompt it is a chat field like the others."""
    msgs = CONTINUE[:1]
    for value in ("none", "minimal", "low", "medium", "high"):
        assert await _tokens(app, messages=msgs, reasoning_effort=value)
    for path in ("/v1/tokenize", "/v1/chat/completions"):
        r = await _call(app, "POST", path, {"messages": msgs, "reasoning_effort": "extreme"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    r = await _call(app, "POST", "/v1/tokenize", {"prompt": "hi", "reasoning_effort": "low"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


async def test_tokenize_continues_the_final_message(app, tok):
    """The issue's fault: the tokens ended with the end-of-turn marker and a newline."""
    ids = await _tokens(app, messages=CONTINUE, continue_final_message=True,
                        add_generation_prompt=False)
    assert tok.decode(ids).endswith("1. Red\n2.")
    # SGLang's convention (issue 28): a continuation without add_generation_prompt has none
    assert await _tokens(app, messages=CONTINUE, continue_final_message=True) == ids
    closed = await _tokens(app, messages=CONTINUE, add_generation_prompt=False)
    assert tok.decode(closed).endswith("<|im_end|>\n") and len(closed) > len(ids)
    tools = await _tokens(app, messages=CONTINUE[:1], tools=TOOLS)
    assert "get_weather" in tok.decode(tools)


@pytest.mark.parametrize("body,param", [
    ({"messages": CONTINUE, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ({"messages": CONTINUE[:1], "continue_final_message": True,
      "add_generation_prompt": False}, "continue_final_message"),
    ({"messages": CONTINUE[:1], "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs.tools"),
    ({"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
    ({"prompt": "hi", "tools": TOOLS}, "tools"),
    ({"prompt": "hi", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs"),
    ({"messages": CONTINUE[:1], "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"messages": CONTINUE[:1], "tool_choice": "auto"}, "tool_choice"),
])
async def test_tokenize_checks_the_chat_fields_as_chat_does(app, body, param):
    r = await _call(app, "POST", "/v1/tokenize", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/tokenize", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"}),
    ("/v1/tokenize", {"messages": CONTINUE[:1]}),
    ("/v1/detokenize", {"tokens": [1, 2]}), ("/detokenize", {"tokens": [1, 2]})])
async def test_an_unknown_field_is_a_400_naming_it_on_every_tokenizer_route(app, path, body):
    r = await _call(app, "POST", path, {**body, "frobnicate": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("frobnicate", "unrecognized_field")
    assert (await _call(app, "POST", path, body)).status_code == 200


async def test_model_info_in_sglangs_shape(app):
    for path in ("/model_info", "/get_model_info"):
        r = await _call(app, "GET", path)
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["is_generation"] is True
        assert info["model_path"] == info["tokenizer_path"] == "SmolLM2-135M-Instruct"
        assert info["served_model_name"] == "SmolLM2-135M-Instruct"
    app2, _ = make_app(model_path="/m/Foo.Q4_K_M.gguf", tokenizer_path="/m/tok",
                       served_model_name="foo")
    info = (await _call((app2, None), "GET", "/model_info")).json()
    assert (info["model_path"], info["tokenizer_path"], info["served_model_name"]) == (
        "/m/Foo.Q4_K_M.gguf", "/m/tok", "foo")


async def test_get_server_info_is_server_info_with_what_the_routers_read(app):
    a = (await _call(app, "GET", "/server_info")).json()
    b = (await _call(app, "GET", "/get_server_info")).json()
    assert a.keys() == b.keys()
    for key in ("served_model_name", "model_path", "tokenizer_path", "tp_size", "dp_size",
                "max_running_requests", "max_prefill_tokens", "num_running", "stats"):
        assert key in a, key
    assert (a["served_model_name"], a["dp_size"], a["tp_size"]) == (
        "SmolLM2-135M-Instruct", 1, 1)


async def test_server_info_shows_the_effective_prefill_chunk(tok):
    """``chunked_prefill_size``: the prefill chunk the scheduler uses (tokens)."""
    for kw, chunk in (({}, 2048), ({"chunked_prefill_size": 512}, 512),
                      ({"chunked_prefill_size": -1, "max_prefill_tokens": 8192}, 8192),
                      ({"chunked_prefill_size": 4096, "max_prefill_tokens": 1024}, 1024)):
        app = make_app(**kw)
        app[1].tm.set_tokenizer(tok)
        info = (await _call(app, "GET", "/server_info")).json()
        assert info["chunked_prefill_size"] == chunk, kw


async def test_health_generate_runs_one_token(app):
    engine = app[1]
    before = len(engine.rids)
    r = await _call(app, "GET", "/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert len(engine.rids) == before + 1
    sent = engine.sent[-1]
    assert sent.sampling_params.max_tokens == 1 and sent.rid.startswith("health-")
    engine.tm.dead = "the engine died"
    assert (await _call(app, "GET", "/health_generate")).status_code == 503


async def test_health_generate_times_out_with_a_503(app, monkeypatch):
    import server.app

    monkeypatch.setattr(server.app, "HEALTH_GENERATE_TIMEOUT_S", 0.2)
    app2, engine = make_app()
    engine.hold = True  # the engine never answers
    r = await _call((app2, engine), "GET", "/health_generate")
    assert r.status_code == 503 and "no token" in r.json()["error"]["message"]
    assert not engine.tm.states  # the request was aborted


async def test_get_load(app):
    app[1].num_running = 3
    r = await _call(app, "GET", "/get_load")
    assert r.status_code == 200
    assert r.json() == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 0, "num_tokens": 0}]


async def test_the_new_routes_need_the_api_key():
    app, _ = make_app(api_key="k")
    for path in ("/model_info", "/get_model_info", "/get_server_info", "/health_generate",
                 "/get_load"):
        assert (await _call((app, None), "GET", path)).status_code == 401, path


@pytest.mark.parametrize("quantization", [None, "fp8", "gguf"])
async def test_server_info_reports_quantization(tok, quantization):
    """``/server_info`` and ``/get_server_info`` report ``--quantization`` (null when not
    given), as SGLang's server-args dump does."""
    app = make_app(quantization=quantization)
    for path in ("/server_info", "/get_server_info"):
        info = (await _call(app, "GET", path)).json()
        assert "quantization" in info and info["quantization"] == quantization, path
