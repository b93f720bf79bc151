"""Anthropic's Messages API (``server/anthropic/``) without processes: the request mapping
onto a chat body, the event writer over the chat format's chunks, and the routes over a
fake engine with the official ``anthropic`` SDK (errors, ``x-api-key``, ``count_tokens``)."""

from __future__ import annotations

import json

import pytest
from app_helpers import make_app
from starlette.testclient import TestClient

from server.anthropic.errors import error_response
from server.anthropic.events import MessageBuilder
from server.anthropic.request import parse_messages_request, to_chat
from server.http.errors import APIError
from server.openai.formats import ChatFormat
from server.openai.tool_format import ToolChatFormat
from server.tokenizer_manager import ReqOutput
from server.tools.plan import ToolPlan

anthropic = pytest.importorskip("anthropic")

M = "SmolLM2-135M-Instruct"
V = {"anthropic-version": "2023-06-01"}
TOOL = {"name": "get_weather", "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}


def _body(**kw) -> dict:
    return {"model": M, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
            **kw}


# ---- the request mapping -------------------------------------------------------------------

def test_system_blocks_tools_and_sampling_map_onto_a_chat_body():
    req = parse_messages_request(_body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xx"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                 "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "And tomorrow?"}]}],
        tools=[dict(TOOL, cache_control={"type": "ephemeral"})],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=20,
        thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048,
        metadata={"user_id": "u-1"}, service_tier="auto", seed=7))
    body, origins = to_chat(req)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "use the tool",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "toolu_2", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]
    assert origins.where == ["system", "messages[0]", "messages[1]",
                             "messages[2].content[0]", "messages[2].content[1]", "messages[2]"]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": TOOL["input_schema"]}}]
    # in OpenAI's key order: the template writes the tool as given, so the same tool sent to
    # chat and to Messages renders the same prompt
    assert list(body["tools"][0]["function"]) == ["name", "description", "parameters"]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["stop"] == ["END"] and body["max_completion_tokens"] == 2048
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.5, 0.9, 20, 7)
    assert body["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize("choice, chat", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choice(choice, chat):
    body, _ = to_chat(parse_messages_request(_body(tools=[TOOL], tool_choice=choice)))
    assert body["tool_choice"] == chat


def test_thinking_disabled_and_output_format():
    body, _ = to_chat(parse_messages_request(_body(
        thinking={"type": "disabled"},
        output_config={"effort": "low", "format": {"type": "json_schema",
                                                   "schema": {"type": "object"}}})))
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "output", "schema": {"type": "object"}}}


_ASK = {"role": "user", "content": "Weather in Paris?"}
_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                          "name": "get_weather", "input": {"city": "Paris"}}]}
_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}


@pytest.mark.parametrize("body, param", [
    (_body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages[0].content[0].source.type"),
    (_body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
     "messages[0].content[0].type"),
    (_body(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]),
     "messages[0].content[0].x"),
    (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (_body(thinking={"type": "enabled", "budget_tokens": 100}), "thinking.budget_tokens"),
    (_body(thinking={"type": "enabled", "budget_tokens": 2048}), "thinking.budget_tokens"),
    (_body(metadata={"user_id": "u" * 600}), "metadata.user_id"),
    (_body(metadata={"other": 1}), "metadata.other"),
    (_body(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), "mcp_servers"),
    (_body(frequency_penalty=1.0, unknown_field=1), "unknown_field"),
    (_body(max_tokens=0), "max_tokens"),
    (_body(temperature=1.5), "temperature"),
    (_body(tool_choice={"type": "required"}), "tool_choice.type"),
    # a tool_result must answer a tool_use of the message just before it
    (_body(messages=[{"role": "user", "content": [_RESULT]}]),
     "messages[0].content[0].tool_use_id"),
    (_body(messages=[_ASK, _USE, {"role": "user", "content": [
        _RESULT, dict(_RESULT, tool_use_id="toolu_9")]}]),
     "messages[2].content[1].tool_use_id"),
    (_body(messages=[_ASK, {"role": "assistant", "content": "No tool."},
                     {"role": "user", "content": [_RESULT]}]),
     "messages[2].content[0].tool_use_id"),
    # a tool_use two messages back does not count (Anthropic: "in the previous message")
    (_body(messages=[_ASK, _USE, {"role": "user", "content": [_RESULT]},
                     {"role": "assistant", "content": "Sunny."},
                     {"role": "user", "content": [_RESULT]}]),
     "messages[4].content[0].tool_use_id"),
    # one tool_use answered twice; one id on two tool_use blocks; empty content
    (_body(messages=[_ASK, _USE, {"role": "user", "content": [_RESULT, _RESULT]}]),
     "messages[2].content[1].tool_use_id"),
    (_body(messages=[_ASK, {"role": "assistant", "content": _USE["content"] * 2}]),
     "messages[1].content[1].id"),
    (_body(messages=[{"role": "user", "content": []}]), "messages[0].content"),
    (_body(messages=[_ASK, {"role": "assistant", "content": []}, _ASK]), "messages[1].content"),
])
def test_bad_bodies_name_the_field(body, param):
    with pytest.raises(APIError) as exc:
        to_chat(parse_messages_request(body))
    assert exc.value.status == 400 and exc.value.param == param


def test_wrong_type_is_not_called_missing():
    body = _body(messages=[_ASK, _USE, {"role": "user", "content": [
        dict(_RESULT, tool_use_id=1)]}])
    with pytest.raises(APIError) as exc:
        to_chat(parse_messages_request(body))
    assert exc.value.message.endswith("tool_use_id: expected a string")


def test_empty_final_assistant_message_is_a_prefill():
    body, _ = to_chat(parse_messages_request(_body(messages=[
        _ASK, {"role": "assistant", "content": []}])))
    assert body["messages"][-1] == {"role": "assistant", "content": ""}


def test_documented_noops_are_accepted():
    req = parse_messages_request(_body(
        cache_control={"type": "ephemeral"}, context_management={"edits": []},
        container=None, mcp_servers=[], inference_geo="us", speed="standard",
        diagnostics={}, service_tier="standard_only"))
    assert to_chat(req)[0]["max_completion_tokens"] == 16


# ---- the event writer ----------------------------------------------------------------------

def _out(text: str, fin: str | None = None, matched=None, n: int = 1) -> ReqOutput:
    return ReqOutput(0, text, [1] * n, None if fin is None else {"type": fin,
                                                                 "matched": matched},
                     10, n, cached_tokens=4)


def _run(build: MessageBuilder, outs: list[ReqOutput]) -> list[dict]:
    return [e for o in outs for e in build.feed(o)]


def test_text_stream_events_and_message():
    build = MessageBuilder("msg_1", M, ChatFormat("r", M, 1, 10, False), ["END"])
    events = _run(build, [_out("Hel"), _out("lo", "stop", "END", 2)])
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"][
        "cache_read_input_tokens"] == 4
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[-2]["usage"] == {"input_tokens": 6, "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 4, "output_tokens": 2}
    msg = build.message()
    assert msg["content"] == [{"type": "text", "text": "Hello"}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")


@pytest.mark.parametrize("fin, matched, reason", [
    ("stop", 2, "end_turn"), ("stop", "other", "end_turn"), ("length", None, "max_tokens")])
def test_stop_reasons(fin, matched, reason):
    build = MessageBuilder("m", M, ChatFormat("r", M, 1, 10, False), ["END"])
    _run(build, [_out("x", fin, matched)])
    assert build.message()["stop_reason"] == reason
    assert build.message()["stop_sequence"] is None


def test_named_tool_call_streams_input_json_deltas():
    plan = ToolPlan(tools=[{"type": "function", "function": {"name": "get_weather"}}],
                    choice="named", name="get_weather")
    build = MessageBuilder("m", M, ToolChatFormat(plan, "r", M, 1, 10, False), [])
    events = _run(build, [_out('{"city": '), _out('"Paris"}', "stop", 2)])
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert all(d["type"] == "input_json_delta" for d in deltas)
    assert "".join(d["partial_json"] for d in deltas) == '{"city": "Paris"}'
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["input"] == {} and start["content_block"]["type"] == "tool_use"
    msg = build.message()
    assert msg["stop_reason"] == "tool_use"
    assert msg["content"][0]["input"] == {"city": "Paris"}
    assert msg["content"][0]["id"].startswith("toolu_")


def test_an_abort_is_an_error():
    build = MessageBuilder("m", M, ChatFormat("r", M, 1, 10, False), [])
    with pytest.raises(APIError):
        build.feed(_out("x", "abort"))


# ---- the routes over a fake engine, with the official SDK ---------------------------------

@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(None)


def _client(tok, key: str | None = None, **kw):
    app, engine = make_app(**kw)
    engine.tm.set_tokenizer(tok)
    # the SDK's own httpx (httpx2 in anthropic >= 2.16, httpx before)
    hx = getattr(anthropic._base_client, "httpx2", None) or anthropic._base_client.httpx
    client = anthropic.AsyncAnthropic(base_url="http://t", api_key=key or "x", max_retries=0,
                                      http_client=hx.AsyncClient(
                                          transport=hx.ASGITransport(app=app),
                                          base_url="http://t"))
    return client, app, engine


async def test_sdk_create_stream_and_count_tokens(tok):
    client, _, engine = _client(tok)
    msg = await client.messages.create(model=M, max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].text == "ok" and msg.stop_reason == "max_tokens"
    async with client.messages.stream(model=M, max_tokens=4,
                                      messages=[{"role": "user", "content": "hi"}]) as s:
        final = await s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    counted = await client.messages.count_tokens(
        model=M, messages=[{"role": "user", "content": "hi"}])
    assert counted.input_tokens == len(engine.sent[0].input_ids) == \
        msg.usage.input_tokens + msg.usage.cache_read_input_tokens


async def test_sdk_errors_are_anthropic_shaped(tok):
    client, _, _ = _client(tok)
    with pytest.raises(anthropic.BadRequestError) as exc:
        await client.messages.create(model=M, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert exc.value.body["type"] == "error"
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    # a text-only model: the image block's source is named, in Anthropic's terms
    assert "messages[0].content[0].source" in exc.value.body["error"]["message"]
    assert "image_url" not in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as exc:
        await client.messages.create(model="claude-nope", max_tokens=4,
                                     messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["error"]["type"] == "not_found_error"


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}


async def test_sdk_unexpected_tool_use_id_is_anthropic_shaped(tok):
    """Anthropic's 400 for a tool_result of no tool_use in the message before: its error
    type and text, the block named; nothing reaches the engine; a matching one runs."""
    client, _, engine = _client(tok)
    with pytest.raises(anthropic.BadRequestError) as exc:
        await client.messages.create(model=M, max_tokens=4, tools=[TOOL], messages=[
            _ASK, _USE, {"role": "user", "content": [dict(_RESULT, tool_use_id="toolu_X")]}])
    assert exc.value.status_code == 400 and exc.value.body["type"] == "error"
    err = exc.value.body["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("messages[2].content[0].tool_use_id: unexpected "
                                     "`tool_use_id` found in `tool_result` blocks: toolu_X")
    assert engine.sent == []
    msg = await client.messages.create(model=M, max_tokens=4, tools=[TOOL], messages=[
        _ASK, _USE, {"role": "user", "content": [_RESULT]}])
    assert msg.content[0].text == "ok" and len(engine.sent) == 1


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": [{"type": "text", "text": "what is it?"}, IMAGE]}],
     "messages[0].content[1].source"),
    # the tool result is taken out of the user's chat parts: the block's own index is named
    ([{"role": "user", "content": "weather?"},
      {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                         "name": "get_weather", "input": {"city": "Paris"}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                    "content": "sunny"}, IMAGE]}],
     "messages[2].content[1].source")])
def test_an_image_on_a_text_only_model_names_the_anthropic_block(tok, messages, param):
    _, app, _ = _client(tok)
    r = TestClient(app).post("/v1/messages", headers=V, json=_body(
        messages=messages, tools=[TOOL]))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith(param + ":"), err
    assert "image_url" not in err["message"]


def test_an_assistant_prefill_is_continued(tok):
    req = parse_messages_request(_body(messages=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"}]))
    body, _ = to_chat(req)
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert "continue_final_message" not in to_chat(parse_messages_request(_body()))[0]
    _, app, engine = _client(tok)
    engine.text = " Paris."
    r = TestClient(app).post("/v1/messages", headers=V, json=_body(messages=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"}]))
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": " Paris."}]
    # the prompt ends inside the assistant's text: no end of turn, no new assistant header
    prompt = tok.decode(engine.sent[-1].input_ids)
    assert prompt.rstrip().endswith("The capital of France is"), prompt[-80:]
    assert prompt.count("<|im_start|>assistant") == 1
    # a forced tool call cannot follow a prefill: the 400 names the prefilled message
    r = TestClient(app).post("/v1/messages", headers=V, json=_body(
        tools=[TOOL], tool_choice={"type": "any"}, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me"}]))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[1]")


def test_x_api_key_and_version_header(tok):
    _, app, engine = _client(tok, api_key="sekrit")
    engine.tm.set_tokenizer(tok)
    c = TestClient(app)
    body = _body()
    r = c.post("/v1/messages", json=body, headers=V)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["type"] == "error"
    r = c.post("/v1/messages", json=body, headers={**V, "x-api-key": "wrong"})
    assert r.status_code == 401
    assert c.post("/v1/messages", json=body, headers={**V, "x-api-key": "sekrit"}
                  ).status_code == 200
    assert c.post("/v1/messages", json=body, headers={
        **V, "Authorization": "Bearer sekrit"}).status_code == 200
    # x-api-key on the other routes too; their refusal stays OpenAI-shaped
    assert c.get("/v1/models", headers={"x-api-key": "sekrit"}).status_code == 200
    assert "type" not in c.get("/v1/models").json()
    hdr = {"x-api-key": "sekrit"}
    r = c.post("/v1/messages", json=body, headers=hdr)
    assert r.status_code == 400 and "anthropic-version" in r.json()["error"]["message"]
    for bad in ("2023-6-1", "latest", "2022-12-31", "2023-02-30"):
        r = c.post("/v1/messages", json=body, headers={**hdr, "anthropic-version": bad})
        assert r.status_code == 400, bad
    assert c.post("/v1/messages", json=body, headers={
        **hdr, "anthropic-version": "2027-01-15"}).status_code == 200
    r = c.post("/v1/messages/count_tokens", json=dict(body, max_tokens=3),
               headers={**hdr, **V})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")


@pytest.mark.parametrize("status, shaped", [
    (400, (400, "invalid_request_error")), (401, (401, "authentication_error")),
    (404, (404, "not_found_error")), (413, (413, "request_too_large")),
    (503, (529, "overloaded_error")), (500, (500, "api_error"))])
def test_statuses(status, shaped):
    err = APIError("boom", status, "field")
    resp = error_response(err)
    assert (resp.status_code, json.loads(resp.body)["error"]["type"]) == shaped
    assert json.loads(resp.body)["error"]["message"] == "field: boom"
