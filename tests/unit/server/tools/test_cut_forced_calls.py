"""A forced tool call (``tool_choice: "required"`` or a named function) cut by ``max_tokens``
before any call can be read: no call, and no raw internal JSON as the content (empty content,
``finish_reason: "length"``), on chat, Responses and Messages, streamed or not, as vLLM and
SGLang users expect. The calls and content come from the one shared tool-call output path
(``server/openai/tool_format.py``). Over a fake engine answering the cut text."""

from __future__ import annotations

import json

import httpx
import pytest
from app_helpers import make_app

M = "SmolLM2-135M-Instruct"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CUT = '[{"name": "'  # a ``required`` output cut inside its first name
V = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer


def _app(tok, text: str):
    app, engine = make_app()
    engine.tm.set_tokenizer(tok)
    engine.text = text  # every request finishes with it, finish_reason "length"
    return app


async def _post(app, path: str, body: dict, stream: bool) -> tuple[int, object]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        r = await c.post(path, json=dict(body, stream=stream), headers=V)
    if not stream or r.status_code != 200:
        return r.status_code, r.json()
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return r.status_code, events


def _chat_body(choice) -> dict:
    return {"model": M, "max_tokens": 4, "tools": [TOOL], "tool_choice": choice,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_required_cut_before_a_name_is_empty(tok, stream):
    status, out = await _post(_app(tok, CUT), "/v1/chat/completions",
                              _chat_body("required"), stream)
    assert status == 200, out
    if not stream:
        msg = out["choices"][0]["message"]
        assert msg["content"] == "" and not msg.get("tool_calls")
        assert out["choices"][0]["finish_reason"] == "length"
        return
    deltas = [c["choices"][0]["delta"] for c in out if c.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert not any(d.get("tool_calls") for d in deltas)
    assert [c["choices"][0]["finish_reason"] for c in out if c.get("choices")][-1] == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_required_cut_after_its_name_is_still_a_call(tok, stream):
    """Unchanged: once the name is complete the cut call is a call (OpenAI's shape)."""
    status, out = await _post(_app(tok, '[{"name": "get_weather", "parameters": {"ci'),
                              "/v1/chat/completions", _chat_body("required"), stream)
    assert status == 200, out
    if not stream:
        msg = out["choices"][0]["message"]
        assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
        assert msg["content"] is None and out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_named_cut_before_any_argument_is_empty(tok, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    status, out = await _post(_app(tok, ""), "/v1/chat/completions", _chat_body(choice),
                              stream)
    assert status == 200, out
    if not stream:
        msg = out["choices"][0]["message"]
        assert not msg.get("content") and not msg.get("tool_calls")
        assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_required_cut_has_no_raw_json(tok, stream):
    body = {"model": M, "max_output_tokens": 4, "input": "Weather in Paris?",
            "tools": [{"type": "function", "name": "get_weather",
                       "parameters": TOOL["function"]["parameters"]}],
            "tool_choice": "required", "store": False}
    status, out = await _post(_app(tok, CUT), "/v1/responses", body, stream)
    assert status == 200, out
    resp = out if not stream else [e for e in out if e["type"] == "response.incomplete"][0][
        "response"]
    assert resp["status"] == "incomplete"
    assert not any(i["type"] == "function_call" for i in resp["output"])
    texts = [p.get("text") for i in resp["output"] if i["type"] == "message"
             for p in i["content"]]
    assert all(not t for t in texts), resp["output"]
    if stream:
        assert "".join(e.get("delta", "") for e in out
                       if e["type"] == "response.output_text.delta") == ""


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_any_cut_has_no_raw_json(tok, stream):
    body = {"model": M, "max_tokens": 4, "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"name": "get_weather",
                       "input_schema": TOOL["function"]["parameters"]}]}
    status, out = await _post(_app(tok, CUT), "/v1/messages", body, stream)
    assert status == 200, out
    msg = out if not stream else [e for e in out if e["type"] == "message_delta"][0]["delta"]
    assert msg["stop_reason"] == "max_tokens"
    if not stream:
        assert all(b["type"] == "text" and not b["text"] for b in msg["content"]), msg
    else:
        deltas = [e["delta"] for e in out if e["type"] == "content_block_delta"]
        assert all(d["type"] == "text_delta" and not d["text"] for d in deltas), deltas
