"""Anthropic's Messages API on a real server (the shared one), with the official
``anthropic`` SDK: sync and async clients, the streaming helper's accumulated message, a
tool-use loop that sends the ``tool_result`` back, stream and non-stream giving the same
blocks (greedy), and Anthropic-shaped 4xx for bad bodies."""

from __future__ import annotations

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

M = "SmolLM2-135M-Instruct"
#: greedy (the SDK 2.16 no longer takes `temperature` as a keyword; the API does)
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def sync_client(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def async_client(url):
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", timeout=120,
                                    max_retries=0)


def test_sync_create(sync_client):
    msg = sync_client.messages.create(
        model=M, max_tokens=8, system="You are terse.", extra_body=GREEDY,
        messages=[{"role": "user", "content": "Say hello."}])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens >= 1 and msg.usage.input_tokens >= 1
    assert msg.usage.cache_creation_input_tokens == 0


async def test_async_create_and_count_tokens(async_client):
    msgs = [{"role": "user", "content": "Count to three."}]
    msg = await async_client.messages.create(model=M, max_tokens=6, messages=msgs,
                                             extra_body=GREEDY)
    assert msg.content[0].text
    counted = await async_client.messages.count_tokens(model=M, messages=msgs)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_stream_helper_equals_non_stream(sync_client):
    kw = dict(model=M, max_tokens=12, extra_body=GREEDY,
              messages=[{"role": "user", "content": "Name three colours."}])
    full = sync_client.messages.create(**kw)
    with sync_client.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in full.content]
    assert "".join(texts) == full.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (full.stop_reason,
                                                              full.usage.output_tokens)


def test_stop_sequence(sync_client):
    msg = sync_client.messages.create(
        model=M, max_tokens=40, extra_body=GREEDY, stop_sequences=["3"],
        messages=[{"role": "user", "content": "Count from 1 to 10: 1, 2,"}])
    if msg.stop_reason == "stop_sequence":
        assert msg.stop_sequence == "3" and "3" not in msg.content[0].text
    else:  # the tiny model may never write a 3
        assert msg.stop_sequence is None


def test_tool_use_loop(sync_client):
    kw = dict(model=M, max_tokens=40, extra_body=GREEDY, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"})
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = sync_client.messages.create(messages=msgs, **kw)
    assert msg.stop_reason in ("tool_use", "max_tokens")
    call = msg.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    with sync_client.messages.stream(messages=msgs, **kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == \
        [(b.type, b.name, b.input) for b in msg.content]
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                               for b in msg.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "sunny, 21 C"}]}]
    answer = sync_client.messages.create(model=M, max_tokens=16, extra_body=GREEDY,
                                         tools=[WEATHER], messages=msgs)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("body, status, kind", [
    ({"model": M, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error"),
    ({"model": M, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, 400,
     "invalid_request_error"),
    ({"model": M, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "bogus": 1}, 400, "invalid_request_error"),
    ({"model": "claude-nope", "max_tokens": 4,
      "messages": [{"role": "user", "content": "hi"}]}, 404, "not_found_error"),
])
def test_bad_bodies(url, body, status, kind):
    r = httpx.post(url + "/v1/messages", json=body,
                   headers={"anthropic-version": "2023-06-01"}, timeout=60)
    assert r.status_code == status
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind


def test_stream_events_in_order(url):
    with httpx.stream("POST", url + "/v1/messages", timeout=60,
                      headers={"anthropic-version": "2023-06-01"},
                      json={"model": M, "max_tokens": 4, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as r:
        kinds = [line.split(": ", 1)[1] for line in r.iter_lines()
                 if line.startswith("event: ")]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds
