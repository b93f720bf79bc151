"""Small HTTP helpers shared by the e2e API tests (plain JSON through httpx, so vLLM-style
extension fields go through unchanged)."""

from __future__ import annotations

import json

import httpx

MODEL = "SmolLM2-135M-Instruct"
HTTP_TIMEOUT_S = 120.0


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=HTTP_TIMEOUT_S)


def comp(url: str, prompt, **kw) -> dict:
    """A non-stream completion; asserts a 200."""
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": prompt, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, messages, **kw) -> dict:
    """A non-stream chat completion; asserts a 200."""
    kw.setdefault("temperature", 0)
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def stream_chunks(url: str, path: str, body: dict) -> list[dict]:
    """Every JSON chunk of a streamed response (the final [DONE] is not a chunk)."""
    with httpx.stream("POST", url + path, json=dict(body, stream=True),
                      timeout=HTTP_TIMEOUT_S) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def fold_chat_stream(url: str, body: dict) -> tuple[str, str, dict[int, list[str]], str | None]:
    """A streamed chat completion folded into one message: ``(reasoning_content, content,
    {index: [name, arguments]} of the tool calls, finish_reason)``; asserts a 200."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream_chunks(url, "/v1/chat/completions", body):
        choice = chunk["choices"][0]
        d = choice["delta"]
        reasoning += d.get("reasoning_content") or ""
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], ["", ""])
            call[0] += tc["function"].get("name") or ""
            call[1] += tc["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]


def openai_tour(base_url: str, timeout_s: float = HTTP_TIMEOUT_S):
    """One greedy chat, the same chat streamed, a forced tool call and a Responses call
    through the official client against ``base_url`` (a server, a router, replicas), with the
    checks every front end must pass; returns ``(client, chat, stream chunks, tool call
    completion, response)`` for the caller's own checks."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=timeout_s,
                           max_retries=0)
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content  # greedy: the same text either way
    t = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=WEATHER_TOOLS, tool_choice="required", max_tokens=40, temperature=0)
    assert t.choices[0].message.tool_calls[0].function.name == "get_weather"
    resp = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4,
                                   temperature=0)
    assert resp.output_text
    return client, r, chunks, t, resp
