"""Request models: accepted shapes, bounds mapped to the offending ``param``, strict JSON
types, unsupported fields, chat message rendering input, the OpenAI error shape, reading the
body (nesting depth, stalls) and the prompt's fit in the context."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from engine.sampling.params import SamplingParams
from server.app import model_name_of
from server.http.body import BODY_READ_TIMEOUT_S, read_json
from server.http.errors import APIError
from server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from server.pipeline.prompt import messages_for_template


def comp(**kw):
    return parse_request(CompletionRequest, {"prompt": "hi", **kw})


def chat(messages=None, **kw):
    return parse_request(ChatCompletionRequest,
                         {"messages": messages or [{"role": "user", "content": "hi"}], **kw})


def param_of_error(fn, *a, **kw) -> str | None:
    with pytest.raises(APIError) as ei:
        fn(*a, **kw)
    assert ei.value.status == 400
    return ei.value.param


@pytest.mark.parametrize("prompt,expected", [
    ("x", "x"), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_shapes(prompt, expected):
    assert parse_request(CompletionRequest, {"prompt": prompt}).prompt == expected


@pytest.mark.parametrize("body", [{"prompt": []}, {"prompt": [1, "a"]}, {"prompt": 5},
                                  {"prompt": [[1], "a"]}, {}, {"prompt": None},
                                  {"prompt": [True]}])
def test_bad_prompts(body):
    assert param_of_error(parse_request, CompletionRequest, body) == "prompt"


@pytest.mark.parametrize("field,value", [
    ("temperature", 2.5), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0), ("repetition_penalty", 2.5), ("seed", 2**63),
    ("seed", -(2**63) - 1), ("max_tokens", 0), ("min_tokens", -1), ("n", 0), ("n", 10**6),
    ("stop", [""]), ("stop", ["x"] * 17), ("stop", "y" * 257), ("stop", [1]),
    ("stop_token_ids", [-1]), ("stop_token_ids", list(range(17))),
    ("logit_bias", {"a": 1}), ("logit_bias", {"1": 101}), ("logit_bias", {"1": "x"}),
    ("logit_bias", {str(i): 1 for i in range(1025)}), ("logit_bias", [1]),
    ("temperature", "hot"), ("stream", "maybe"), ("stream_options", 3), ("top_k", 2**31),
    ("min_tokens", 2**31), ("max_tokens", 2**31), ("min_p", -0.1),
])
def test_bounds_name_the_param(field, value):
    assert param_of_error(comp, **{field: value}) == field
    assert param_of_error(chat, **{field: value}) == field


def test_nan_is_refused():
    body = json.loads('{"prompt": "x", "temperature": NaN}')
    assert param_of_error(parse_request, CompletionRequest, body) == "temperature"


def test_null_means_absent_and_defaults():
    r = comp(temperature=None, stream_options=None, max_tokens=None, stop=None, n=None)
    assert r.temperature == 1.0 and r.stream_options is None and r.n == 1
    assert r.max_tokens == 16 and r.stop == []  # OpenAI's completions default
    assert not r.include_usage
    assert comp(stream=True, stream_options={"include_usage": True}).include_usage
    c = chat()
    assert c.requested_max_tokens is None  # chat: up to the context
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens == 7


def test_sampling_params_mapping():
    r = comp(temperature=0.3, top_p=0.8, top_k=5, min_p=0.05, seed=-7, stop="END",
             stop_token_ids=[3], ignore_eos=True, presence_penalty=0.1,
             frequency_penalty=0.2, repetition_penalty=1.3, logit_bias={"11": -5, "12": 100},
             min_tokens=2, skip_special_tokens=False, spaces_between_special_tokens=False)
    sp = r.sampling_params(r.max_tokens)
    assert sp == SamplingParams(max_tokens=16, min_tokens=2, temperature=0.3, top_p=0.8,
                                top_k=5, min_p=0.05, seed=-7, stop=["END"],
                                stop_token_ids=[3], ignore_eos=True, presence_penalty=0.1,
                                frequency_penalty=0.2, repetition_penalty=1.3,
                                logit_bias={11: -5.0, 12: 100.0}, skip_special_tokens=False,
                                spaces_between_special_tokens=False)
    sp.verify(49152)


@pytest.mark.parametrize("field,value", [
    # tools, tool_choice and response_format: tests/unit/server/tools/test_structured.py
    ("functions", [{"name": "f"}]),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "x"}),
])
def test_unsupported_fields_name_themselves(field, value):
    assert param_of_error(chat, **{field: value}) == field


def test_harmless_fields_are_ignored():
    chat(user="u", metadata={"a": "b"}, store=False, parallel_tool_calls=True, tools=[],
         tool_choice="none", response_format={"type": "text"}, modalities=["text"],
         service_tier="auto", logprobs=False, top_logprobs=0,
         echo=False)
    comp(user="u", echo=False, best_of=1, suffix="")


def test_not_supported_yet():
    assert param_of_error(comp, best_of=3) == "best_of"
    assert param_of_error(comp, suffix="x") == "suffix"
    assert param_of_error(chat, echo=True) == "echo"  # completions only
    assert param_of_error(comp, logprobs=21) == "logprobs"  # out of bounds
    assert param_of_error(chat, top_logprobs=21, logprobs=True) == "top_logprobs"
    assert param_of_error(chat, top_logprobs=2) == "top_logprobs"  # needs logprobs: true


def test_logprobs_mapping():
    """completions logprobs=k -> k per generated token; echo adds k per prompt token; chat
    logprobs=true -> top_logprobs (0 when absent)."""
    assert comp().sampling_params(4).logprobs is None
    sp = comp(logprobs=3).sampling_params(4)
    assert (sp.logprobs, sp.prompt_logprobs) == (3, None)
    sp = comp(logprobs=0, echo=True).sampling_params(4)
    assert (sp.logprobs, sp.prompt_logprobs) == (0, 0)
    sp = comp(echo=True).sampling_params(4)
    assert (sp.logprobs, sp.prompt_logprobs) == (None, None)
    assert chat(logprobs=True).sampling_params(4).logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).sampling_params(4).logprobs == 5
    assert chat(logprobs=False, top_logprobs=0).sampling_params(4).logprobs is None
    assert chat().sampling_params(4).logprobs is None


def test_tokenize_bodies():
    r = parse_request(TokenizeRequest, {"prompt": "hi"})
    assert r.prompt == "hi" and r.messages is None and r.add_generation_prompt
    r = parse_request(TokenizeRequest, {"messages": [{"role": "user", "content": "x"}],
                                        "add_generation_prompt": False})
    assert r.prompt is None and not r.add_generation_prompt
    assert param_of_error(parse_request, TokenizeRequest, {}) == "prompt"
    assert param_of_error(parse_request, TokenizeRequest, {"prompt": 3}) == "prompt"
    assert param_of_error(parse_request, TokenizeRequest,
                          {"prompt": "a", "messages": [{"role": "user"}]}) == "prompt"
    assert parse_request(DetokenizeRequest, {"tokens": [1, 2]}).tokens == [1, 2]
    for bad in ({"tokens": ["a"]}, {"tokens": [1] * ((1 << 17) + 1)}, {}):
        assert param_of_error(parse_request, DetokenizeRequest, bad).startswith("tokens")


def test_messages_rendering_input():
    r = chat([{"role": "developer", "content": "be brief"},
              {"role": "user", "content": [{"type": "text", "text": "a"},
                                           {"type": "text", "text": "b"}]},
              {"role": "assistant", "content": None},
              {"role": "user", "content": "again"}])
    assert messages_for_template(r.messages) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}],
     "messages[0].content[0].image_url"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:,", "detail": "ultra"}}]}], "messages[0].content[0].image_url.detail"),
    ([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}],
     "messages[1].role"),
    ([{"role": "function", "content": "r", "name": "f"}], "messages[0].role"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
])
def test_bad_messages(messages, param):
    r = chat(messages)
    assert param_of_error(messages_for_template, r.messages) == param


def test_message_shape_errors_name_the_path():
    assert param_of_error(parse_request, ChatCompletionRequest, {"messages": []}) == "messages"
    assert param_of_error(parse_request, ChatCompletionRequest,
                          {"messages": [{"content": "x"}]}) == "messages[0].role"
    assert param_of_error(parse_request, ChatCompletionRequest, {"messages": "hi"}) \
        == "messages"
    assert param_of_error(parse_request, ChatCompletionRequest, [1, 2]) is None


def test_error_shape():
    e = APIError("nope", 400, "temperature")
    assert e.body() == {"error": {"message": "nope", "type": "invalid_request_error",
                                  "param": "temperature", "code": None}}
    assert APIError("x", 503).body()["error"]["type"] == "service_unavailable"
    assert APIError("x", 401).body()["error"]["type"] == "authentication_error"
    assert e.sse().startswith("data: {") and e.sse().endswith("\n\n")
    assert json.loads(e.sse()[len("data: "):]) == e.body()


@pytest.mark.parametrize("path,served,name", [
    (None, None, "SmolLM2-135M-Instruct"),
    ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", None, "SmolLM2-135M-Instruct"),
    ("/m/qwen2.5-0.5b-instruct-q8_0.gguf", None, "qwen2.5-0.5b-instruct-q8_0"),
    ("/models/Llama-3.2-1B-Instruct/", None, "Llama-3.2-1B-Instruct"),
    ("/models/x", "my-model", "my-model"),
])
def test_model_name(path, served, name):
    assert model_name_of(SimpleNamespace(model_path=path, served_model_name=served)) == name


# ---- strict JSON types (OpenAI answers 400 to these; pydantic's lax mode would coerce) ------

@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("max_tokens", 2.0), ("max_tokens", "5"), ("n", "5"), ("n", 2.0),
    ("n", True), ("seed", "5"), ("seed", 5.0), ("min_tokens", 1.0), ("top_k", 5.0),
    ("temperature", True), ("top_p", False), ("temperature", "0.5"), ("stream", "yes"),
    ("stream", "on"), ("stream", 1), ("stream", 0), ("ignore_eos", 1),
    ("skip_special_tokens", "false"),
    ("logit_bias", {" 5 ": 1}), ("logit_bias", {"1_0": 1}), ("logit_bias", {"٣": 1}),
    ("logit_bias", {"+5": 1}), ("logit_bias", {"5\n": 1}), ("logit_bias", {"0x10": 1}),
    ("logit_bias", {"5": True}), ("logit_bias", {"1" * 5000: 1}),
])
def test_loose_types_are_refused(field, value):
    assert param_of_error(comp, **{field: value}) == field
    assert param_of_error(chat, **{field: value}) == field


@pytest.mark.parametrize("make,field,value,param", [
    (chat, "logprobs", 0, "logprobs"), (chat, "logprobs", 1, "logprobs"),
    (chat, "logprobs", "true", "logprobs"), (chat, "top_logprobs", 2.0, "top_logprobs"),
    (chat, "max_completion_tokens", 3.0, "max_completion_tokens"),
    (comp, "logprobs", True, "logprobs"), (comp, "logprobs", 1.0, "logprobs"),
    (comp, "echo", 1, "echo"), (comp, "best_of", True, "best_of"),
    (comp, "stream_options", {"include_usage": 1}, "stream_options.include_usage"),
    (comp, "stop_token_ids", [2.0], "stop_token_ids[0]"),
    (chat, "stop_token_ids", [3, True], "stop_token_ids[1]"),
])
def test_loose_types_per_endpoint(make, field, value, param):
    kw = {"stream": True} if field == "stream_options" else {}
    assert param_of_error(make, **{field: value}, **kw) == param


def test_strict_types_keep_what_clients_send():
    # floats take JSON integers (as OpenAI's API does); ints and bools their own JSON types
    r = comp(temperature=0, top_p=1, min_p=0, presence_penalty=-2, frequency_penalty=2,
             repetition_penalty=1, max_tokens=3, n=2, seed=-5, stream=True,
             stream_options={"include_usage": True}, logit_bias={"7": 5, "-0": -100.0,
                                                                 "0012": 0.5})
    assert r.temperature == 0.0 and isinstance(r.temperature, float)
    assert r.max_tokens == 3 and r.n == 2 and r.seed == -5 and r.include_usage
    assert r.logit_bias == {7: 5.0, 0: -100.0, 12: 0.5}
    c = chat(logprobs=True, top_logprobs=2, max_completion_tokens=4, stream=False)
    assert c.logprobs_k == 2 and c.requested_max_tokens == 4
    assert parse_request(DetokenizeRequest, {"tokens": [1, 2]}).tokens == [1, 2]
    assert param_of_error(parse_request, DetokenizeRequest, {"tokens": [1.0]}) == "tokens[0]"
    assert param_of_error(parse_request, TokenizeRequest,
                          {"prompt": "x", "add_special_tokens": 1}) == "add_special_tokens"


# ---- stream_options needs stream: true -------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"stream": False}])
def test_stream_options_without_stream(kw):
    opts = {"include_usage": True}
    assert param_of_error(comp, stream_options=opts, **kw) == "stream_options"
    assert param_of_error(chat, stream_options=opts, **kw) == "stream_options"
    assert comp(stream_options=None, **kw).stream_options is None  # null = absent
    assert chat(stream=True, stream_options=opts).include_usage


# ---- n: the message states the server's real limit -------------------------------------------

@pytest.mark.parametrize("n", [17, 129, 1000, 2**70])
def test_n_limit_is_the_servers(n):
    for model, body in ((CompletionRequest, {"prompt": "hi"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user",
                                                               "content": "hi"}]})):
        with pytest.raises(APIError) as ei:
            parse_request(model, dict(body, n=n), max_n=16)
        assert ei.value.status == 400 and ei.value.param == "n"
        assert "16" in ei.value.message and "128" not in ei.value.message
    assert parse_request(CompletionRequest, {"prompt": "hi", "n": 16}, max_n=16).n == 16
    with pytest.raises(APIError) as ei:  # best_of must equal n, whatever its size
        parse_request(CompletionRequest, {"prompt": "hi", "best_of": 1000}, max_n=16)
    assert ei.value.param == "best_of" and "128" not in ei.value.message


# ---- the request body: depth, stalls -----------------------------------------------------------

def _request(chunks, headers=(), stall=False):
    """A starlette Request whose body arrives as ``chunks``; then it stalls (``stall``) or
    ends."""
    from starlette.requests import Request

    msgs = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    if not stall:
        msgs.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive():
        if msgs:
            return msgs.pop(0)
        await asyncio.sleep(3600)  # a client that stopped sending
        raise AssertionError("unreachable")

    headers = [("content-type", "application/json"), *headers]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
        (k.encode(), v.encode()) for k, v in headers], "query_string": b""}
    return Request(scope, receive)


def _nested(depth: int) -> bytes:
    return b'{"x": ' + b"[" * depth + b"]" * depth + b', "prompt": "Hi"}'


@pytest.mark.parametrize("body", [
    _nested(1000), _nested(100_000), b'{"a":' * 5000 + b"1" + b"}" * 5000,
    b'{"prompt": "x", "m": ' + b'{"a": [' * 600 + b"1" + b"]}" * 600 + b"}",
])
async def test_deeply_nested_json_is_a_400(body):
    with pytest.raises(APIError) as ei:
        await read_json(_request([body]), 1 << 20)
    assert ei.value.status == 400 and ei.value.type == "invalid_request_error"


@pytest.mark.parametrize("body,says", [
    (b'{"prompt": "a\\ud800b"}', "lone UTF-16 surrogate"),       # msgspec: "truncated"
    (b'{"prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"prompt": "x", "top_p": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"prompt": "x",}', "trailing comma"),                       # msgspec's own words
    (b'{"prompt": "\\ud83d\\ude00", "n": 1e400}', "Number out of range"),  # a valid pair
])
async def test_strict_json_refusals_say_what_is_wrong(body, says):
    with pytest.raises(APIError) as ei:
        await read_json(_request([body]), 1 << 20)
    assert ei.value.status == 400 and says in ei.value.message, ei.value.message


async def test_moderately_nested_json_is_fine():
    body = await read_json(_request([_nested(50)]), 1 << 20)
    assert body["prompt"] == "Hi"
    # decoded fine; the unknown field "x" is then a 400 naming it (nothing is dropped)
    assert param_of_error(parse_request, CompletionRequest, body) == "x"
    del body["x"]
    assert parse_request(CompletionRequest, body).prompt == "Hi"


async def test_stalled_body_is_a_408_that_closes():
    req = _request([b'{"prompt": "'], headers=[("content-length", "100")], stall=True)
    t0 = time.monotonic()
    with pytest.raises(APIError) as ei:
        await read_json(req, 1 << 20, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5
    err = ei.value
    assert err.status == 408 and err.code == "request_timeout"
    assert err.headers == {"Connection": "close"}
    assert err.body()["error"]["type"] == "invalid_request_error"
    # a body that arrives in time is read whole, however many pieces it comes in
    ok = _request([b'{"prompt": ', b'"a"', b"}"])
    assert await read_json(ok, 1 << 20, timeout_s=5) == {"prompt": "a"}


def test_body_read_timeout_default():
    assert 5 <= BODY_READ_TIMEOUT_S <= 120  # seconds: slow links pass, stalls do not stay


# ---- prompt + max_tokens / min_tokens against the context ------------------------------------

def _check(n_prompt: int, max_tokens, param="prompt", ctx=100, **kw):
    """``TokenizerManager.check_prompt`` on a context of ``ctx`` tokens; the error's param."""
    from server.tokenizer_manager import TokenizerManager

    fake = SimpleNamespace(vocab_size=1000, max_context_len=ctx,  # a text-only model
                           check_image_tokens=lambda ids, images, param: None)
    try:
        TokenizerManager.check_prompt(fake, [1] * n_prompt, max_tokens, param, **kw)
    except APIError as e:
        assert e.status == 400
        return e
    return None


def test_context_overflow_names_the_cause():
    # the prompt alone leaves no room: the prompt is at fault, whatever max_tokens says
    e = _check(100, 5, max_tokens_param="max_tokens")
    assert e.param == "prompt" and e.code == "context_length_exceeded"
    assert "100 tokens" in e.message and "105" in e.message  # hand-computed: 100 + 5
    assert _check(150, None).param == "prompt"
    assert _check(100, None, "messages", max_tokens_param="max_completion_tokens").param \
        == "messages"
    # the prompt fits; the asked max_tokens does not
    e = _check(90, 11, max_tokens_param="max_tokens")
    assert e.param == "max_tokens" and e.code == "context_length_exceeded"
    assert _check(90, 11, "messages", max_tokens_param="max_completion_tokens").param \
        == "max_completion_tokens"
    # max_tokens the client did not send (completions' default of 16): the prompt
    assert _check(90, 16).param == "prompt"
    assert _check(90, 10, max_tokens_param="max_tokens") is None  # exactly the context


def test_min_tokens_bounded_by_the_context():
    e = _check(10, None, "messages", min_tokens=2147483647)
    assert e.param == "min_tokens" and e.code == "context_length_exceeded"
    assert _check(10, None, "messages", min_tokens=91).param == "min_tokens"
    assert _check(10, None, "messages", min_tokens=90) is None
    assert _check(10, 90, min_tokens=90, max_tokens_param="max_tokens") is None


def test_uvicorn_limits_leave_room_for_ferrys_own_503():
    from engine.args import ServerArgs
    from server.http.limits import raise_fd_limit, uvicorn_limits

    args = ServerArgs(max_running_requests=256, max_queued_requests=1024)
    lim = uvicorn_limits(args, 200, fd_limit=65536)
    # above running (the engine's 200) + queued: the admission 503 is ferry's shaped one
    assert lim["limit_concurrency"] > 200 + 1024
    assert 1 <= lim["timeout_keep_alive"] <= 30
    # never more connections than file descriptors
    assert uvicorn_limits(args, None, fd_limit=1024)["limit_concurrency"] < 1024
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert raise_fd_limit(256) >= (256 if hard == resource.RLIM_INFINITY else min(256, hard))


# ---- the header timeout uvicorn lacks (in-process uvicorn, a 0.5 s timeout) --------------------

async def _serve_tiny(monkeypatch, stream_s: float):
    """An in-process uvicorn on GuardedH11Protocol; ``/slow`` streams for ``stream_s``."""
    import socket as socketlib

    import uvicorn

    from server.http import limits as http_limits


    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/slow":
            for _ in range(int(stream_s / 0.1)):
                await send({"type": "http.response.body", "body": b".", "more_body": True})
                await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socketlib.socket()
    sock.bind(("127.0.0.1", 0))
    from engine.args import ServerArgs

    protocol = http_limits.uvicorn_limits(ServerArgs(header_timeout=0.5), None, 65536)["http"]
    assert issubclass(protocol, http_limits.GuardedH11Protocol)
    assert protocol.header_timeout_s == 0.5
    cfg = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30,
                         http=protocol)
    srv = uvicorn.Server(cfg)
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    while not srv.started:
        await asyncio.sleep(0.01)
    return srv, task, sock.getsockname()[1]


async def _closed_within(reader, seconds: float) -> bool:
    """True if the server closes the connection within ``seconds`` (data before EOF ok)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False


async def test_header_timeout_closes_stalled_connections(monkeypatch):
    srv, task, port = await _serve_tiny(monkeypatch, stream_s=1.5)
    try:
        silent = await asyncio.open_connection("127.0.0.1", port)
        partial = await asyncio.open_connection("127.0.0.1", port)
        partial[1].write(b"GET / HTTP/1.1\r\nHost: x\r\n")
        slow = await asyncio.open_connection("127.0.0.1", port)
        slow[1].write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        keep = await asyncio.open_connection("127.0.0.1", port)
        keep[1].write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await keep[0].readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        keep[1].write(b"GET / HTTP/1.1\r\n")  # a second request on it stalls in its headers
        t0 = time.monotonic()
        assert await _closed_within(silent[0], 5)
        assert await _closed_within(partial[0], 5)
        assert await _closed_within(keep[0], 5)
        assert time.monotonic() - t0 < 4
        # a response that runs longer than the timeout is not cut
        body = await slow[0].readuntil(b"ok")
        assert body.startswith(b"HTTP/1.1 200") and body.count(b".") >= 14
    finally:
        srv.should_exit = True
        await task


async def test_connections_have_nagle_off(monkeypatch):
    """uvicorn's listening socket has proto 0, so asyncio leaves Nagle on for its connections;
    a streamed response (headers, then the first chunk) then waited for the client's delayed
    ACK on a keep-alive connection (~40 ms of TTFT). The guarded protocol turns Nagle off."""
    import socket as socketlib

    srv, task, port = await _serve_tiny(monkeypatch, stream_s=0.2)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        conns = list(srv.server_state.connections)
        assert conns
        for proto in conns:
            sock = proto.transport.get_extra_info("socket")
            assert sock.proto != socketlib.IPPROTO_TCP  # the case asyncio does not cover
            assert sock.getsockopt(socketlib.IPPROTO_TCP, socketlib.TCP_NODELAY) == 1
        writer.close()
    finally:
        srv.should_exit = True
        await task
