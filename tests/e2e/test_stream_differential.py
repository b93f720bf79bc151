"""Stream and non-stream give the same answer (issue 34 kind 4): a seeded random mix of
requests (chat and completions, ``n``, logprobs, echo, stop strings, min_tokens, tools with
``tool_choice`` auto / required / a named function, small ``max_tokens`` that cut calls
short), each sent once as a stream and once without, against one live server; the streamed
chunks, assembled per choice, must equal the non-stream body: text, tool calls (name and
arguments), finish reason, ``matched_stop`` (on the finishing chunk only), logprob tokens,
bytes, offsets and values, and usage.

The server runs without the prefix cache, and the requests one at a time, so both runs of a
request compute the same logits (a cached prefix or another batch changes float rounding).
"""

from __future__ import annotations

import json
import random

import httpx
import pytest
from api_helpers import HTTP_TIMEOUT_S, MODEL

pytestmark = pytest.mark.slow

#: the session's server of these args (shared with test_prefix_cache_api.py's cache-off test)
SERVER_ARGS = ["--max-total-tokens", "8192", "--disable-radix-cache"]
SERVER_SHARED = True
SEED, COUNT = 34, 10
LP_TOL = 1e-4

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                      "parameters": {"type": "object", "properties": {
                                          "tz": {"type": "string"}}}}}]
QUESTIONS = ["What is the weather in Paris?", "Tell me a short story about a cat.",
             "List three colours, one per line.", "What time is it in Tokyo? Use a tool.",
             "Write the word 😀 three times.", "Say hello in French and German."]
PROMPTS = ["The capital of France is", "Once upon a time, there was a", "1, 2, 3,",
           "Emoji: 😀 🇫🇷 世界 and", "def fibonacci(n):"]
STOPS = [".", ",", "\n", " the", "a", "😀", " 2", "e", "in"]


def _request(rng: random.Random) -> tuple[str, dict]:
    """One random request: (path, body)."""
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, 24),
                  "n": rng.choice([1, 1, 2, 3])}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1000))
    if rng.random() < 0.4:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.15:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < 0.45:
        body["prompt"] = rng.choice(PROMPTS)
        if rng.random() < 0.6:
            body["logprobs"] = rng.randint(0, 3)
            body["echo"] = rng.random() < 0.3
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    if rng.random() < 0.6:
        body["logprobs"] = True
        body["top_logprobs"] = rng.randint(0, 3)
    tools = rng.choice([None, "auto", "required", "named", "named"])
    if tools is not None:
        body["tools"] = TOOLS
        body["tool_choice"] = {"type": "function", "function": {"name": rng.choice(
            ["get_weather", "get_time"])}} if tools == "named" else tools
        if rng.random() < 0.3:
            body["parallel_tool_calls"] = False
    return "/v1/chat/completions", body


def _choice_of_body(path: str, c: dict) -> dict:
    """What is compared of a non-stream choice."""
    if path == "/v1/completions":
        out = {"text": c["text"], "logprobs": c["logprobs"]}
    else:
        msg = c["message"]
        out = {"text": msg.get("content") or "",
               "tool_calls": [(t["function"]["name"], t["function"]["arguments"])
                              for t in msg.get("tool_calls") or []],
               "logprobs": (c["logprobs"] or {}).get("content") if c["logprobs"] else None}
    out.update(finish_reason=c["finish_reason"], matched_stop=c.get("matched_stop"))
    return out


def _assemble(path: str, chunks: list[dict], n: int) -> tuple[list[dict], dict | None]:
    """Per-choice ``_choice_of_body`` shapes from stream chunks, and the usage chunk's usage.
    Checks on the way: matched_stop rides on the finishing chunk only, once per choice."""
    chat = path == "/v1/chat/completions"
    acc = [{"text": "", "tool_calls": {}, "logprobs": None, "finish_reason": None,
            "matched_stop": None, "finishes": 0} for _ in range(n)]
    usage = None
    for ch in chunks:
        if ch.get("usage") and not ch["choices"]:
            usage = ch["usage"]
        for c in ch["choices"]:
            a = acc[c["index"]]
            if "matched_stop" in c:
                assert c["finish_reason"] is not None, ("matched_stop on a chunk that does "
                                                        "not finish", c)
            if c["finish_reason"] is not None:
                a["finish_reason"] = c["finish_reason"]
                a["matched_stop"] = c.get("matched_stop")
                a["finishes"] += 1
            lp = c.get("logprobs")
            if chat:
                d = c["delta"]
                a["text"] += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    e = a["tool_calls"].setdefault(tc["index"], ["", ""])
                    fn = tc.get("function") or {}
                    e[0] += fn.get("name") or ""
                    e[1] += fn.get("arguments") or ""
                if lp:
                    a["logprobs"] = (a["logprobs"] or []) + lp["content"]
            else:
                a["text"] += c["text"]
                if lp:
                    if a["logprobs"] is None:
                        a["logprobs"] = {k: [] for k in lp}
                    for k, v in lp.items():
                        a["logprobs"][k] += v
    out = []
    for a in acc:
        assert a["finishes"] == 1, a
        o = {"text": a["text"], "logprobs": a["logprobs"]}
        if chat:
            o["tool_calls"] = [tuple(a["tool_calls"][k]) for k in sorted(a["tool_calls"])]
        o.update(finish_reason=a["finish_reason"], matched_stop=a["matched_stop"])
        out.append(o)
    return out, usage


def _close(a, b) -> bool:
    """Equal, with logprob values within LP_TOL."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= LP_TOL
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def _stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=dict(body, stream=True, stream_options={
            "include_usage": True}), timeout=HTTP_TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


#: requests the mix must hold whatever the seed: forced calls cut by max_tokens, a stop
#: string next to multi-byte characters with logprobs
FIXED = [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content":
     QUESTIONS[0]}], "tools": TOOLS, "max_tokens": 4, "temperature": 0, "logprobs": True,
     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content":
     QUESTIONS[3]}], "tools": TOOLS, "tool_choice": "required", "max_tokens": 9,
     "temperature": 0, "n": 2}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content":
     QUESTIONS[4]}], "stop": ["😀"], "max_tokens": 12, "temperature": 0, "logprobs": True,
     "top_logprobs": 2}),
]


def test_random_requests_stream_as_they_answer_without(server):
    rng = random.Random(SEED)
    kinds = set()
    for i, (path, body) in enumerate(FIXED + [_request(rng) for _ in range(COUNT)]):
        r = httpx.post(server.url + path, json=body, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, (i, body, r.text)
        full = r.json()
        want = [_choice_of_body(path, c) for c in sorted(full["choices"],
                                                         key=lambda c: c["index"])]
        got, usage = _assemble(path, _stream(server.url, path, body), len(want))
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            assert _close(g, w), (i, k, body, g, w)
        assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} \
            == {k: full["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                              "total_tokens")}, (i, body)
        for w in want:
            kinds.add((path, body.get("tool_choice") if isinstance(
                body.get("tool_choice"), str) else "named" if "tool_choice" in body else None,
                w["finish_reason"], bool(w.get("tool_calls"))))
    # the mix covered what it is for: cut and finished forced calls, stops and lengths
    assert ("/v1/chat/completions", "named", "length", True) in kinds, kinds
    assert any(k[2] == "stop" for k in kinds) and any(k[2] == "length" for k in kinds)
