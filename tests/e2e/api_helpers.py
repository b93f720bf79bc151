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
