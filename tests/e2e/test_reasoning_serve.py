"""``ferry serve --reasoning-parser qwen3 --tool-call-parser hermes`` on a checkpoint whose
greedy answer is known exactly (``scripted_model.py``):
``<think>ponder</think>Sure<tool_call>{"name": "get", "arguments": {"q": 1}}</tool_call>``.

Chat (stream and not), Responses and Anthropic Messages split it into the reasoning, the
content and the tool call; under ``response_format`` the thinking stays free and only the
answer is constrained (to ``{"ok": true}``, the checkpoint's second choice after
``</think>``). One server start-up for the module.
"""

from __future__ import annotations

import json

import httpx
import pytest
from api_helpers import fold_chat_stream
from conftest import FerryServer
from scripted_model import CALL, save_scripted

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get", "parameters": {"type": "object", "properties": {"q": {"type": "integer"}}}}}]
MSG = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("scripted")
    save_scripted(ckpt)
    server = FerryServer(tmp_path_factory.mktemp("ferry-reasoning"), [
        "--model-path", str(ckpt), "--device", "cpu", "--dtype", "float32",
        "--served-model-name", "scripted", "--max-total-tokens", "2048",
        "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json=dict(body, model="scripted"), timeout=srv.http_timeout,
                   headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_reasoning_content_and_tool_call(srv):
    body = _post(srv, "/v1/chat/completions", {"messages": MSG, "tools": TOOLS,
                                               "max_tokens": 16, "temperature": 0})
    choice = body["choices"][0]
    m = choice["message"]
    assert m["reasoning_content"] == "ponder"
    assert m["content"] == "Sure"
    assert [c["function"] for c in m["tool_calls"]] == [
        {"name": "get", "arguments": json.dumps(json.loads(CALL)["arguments"])}]
    assert choice["finish_reason"] == "tool_calls"
    # <think>, ponder, </think>
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_chat_stream_equals_non_stream(srv):
    reasoning, content, calls, finish = fold_chat_stream(srv.url, {
        "model": "scripted", "messages": MSG, "tools": TOOLS, "max_tokens": 16,
        "temperature": 0})
    assert (reasoning, content, finish) == ("ponder", "Sure", "tool_calls")
    assert calls == {0: ["get", '{"q": 1}']}


def test_responses_reasoning_item_message_and_call(srv):
    body = _post(srv, "/v1/responses", {
        "input": "hi", "max_output_tokens": 16, "temperature": 0,
        "tools": [{"type": "function", "name": "get",
                   "parameters": TOOLS[0]["function"]["parameters"]}]})
    kinds = [i["type"] for i in body["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "ponder"}]
    assert body["output"][1]["content"][0]["text"] == "Sure"
    assert body["output"][2]["name"] == "get"
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


def test_anthropic_thinking_block(srv):
    body = _post(srv, "/v1/messages", {"messages": MSG, "max_tokens": 16, "temperature": 0})
    assert body["content"][0] == {"type": "thinking", "thinking": "ponder", "signature": ""}
    assert body["content"][1]["type"] == "text"


def test_structured_output_constrains_the_answer_after_the_thinking(srv):
    rf = {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}
    body = _post(srv, "/v1/chat/completions", {"messages": MSG, "response_format": rf,
                                               "max_tokens": 16, "temperature": 0})
    m = body["choices"][0]["message"]
    assert m["reasoning_content"] == "ponder"
    assert json.loads(m["content"]) == {"ok": True}
    # the whole output as written: the think block, then valid JSON
    body = _post(srv, "/v1/chat/completions", {"messages": MSG, "response_format": rf,
                                               "max_tokens": 16, "temperature": 0,
                                               "separate_reasoning": False})
    text = body["choices"][0]["message"]["content"]
    assert text.startswith("<think>ponder</think>")
    assert json.loads(text.removeprefix("<think>ponder</think>")) == {"ok": True}
