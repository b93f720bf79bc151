"""Issue 28 item 5: vLLM's small routes over the app and a fake engine: ``/invocations``
(SageMaker: a chat body -> chat, a completions body -> completions, by shape), ``/ping``
(GET and POST, no API key), ``/version``, ``/load``, each in ``/openapi.json``.

References: the HF tokenizer (the prompts the engine must get: the chat template, encode),
pyproject.toml's version, the requests the test holds in flight.
"""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import httpx
import openai
import pytest
from app_helpers import make_app

ROOT = Path(__file__).resolve().parents[4]
MSGS = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


def _app(tok, **kw):
    app, engine = make_app(**kw)
    engine.tm.set_tokenizer(tok)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t"), \
        engine


async def test_invocations_routes_by_shape(tok):
    c, engine = _app(tok)
    r = await c.post("/invocations", json={"messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    want = tok.apply_chat_template(MSGS, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert engine.sent[-1].input_ids == want
    r = await c.post("/invocations", json={"prompt": "Hello there", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    assert engine.sent[-1].input_ids == tok.encode("Hello there")
    # the official client pointed at /invocations (SageMaker proxies do this) parses it
    client = openai.AsyncOpenAI(base_url="http://t", api_key="x", max_retries=0,
                                http_client=c)
    comp = await client.post("/invocations", cast_to=openai.types.Completion,
                             body={"prompt": "Hello", "max_tokens": 1})
    assert comp.choices[0].text == "ok"
    # stream through it
    async with c.stream("POST", "/invocations", json={"messages": MSGS, "max_tokens": 1,
                                                      "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"chat.completion.chunk"' in lines[0]


@pytest.mark.parametrize("body,param,text", [
    ({"input": "embed me"}, None, "embeddings"),
    ({"max_tokens": 3}, None, "'messages'"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens", ""),  # chat's own 400
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", ""),  # completions' own 400
])
async def test_invocations_errors(tok, body, param, text):
    c, _ = _app(tok)
    r = await c.post("/invocations", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"]
    r = await c.post("/invocations", content=b"[1]", headers={"content-type":
                                                             "application/json"})
    assert r.status_code == 400
    r = await c.post("/invocations", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 415


async def test_ping_version_load(tok):
    c, engine = _app(tok, api_key="k")
    for method in ("GET", "POST"):
        r = await c.request(method, "/ping")  # no key needed, as /health
        assert r.status_code == 200 and r.json()["status"] == "ok"
    assert (await c.get("/version")).status_code == 401
    auth = {"Authorization": "Bearer k"}
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (await c.get("/version", headers=auth)).json() == {"version": want}
    assert (await c.get("/load", headers=auth)).json() == {"server_load": 0}
    engine.hold = True
    task = asyncio.ensure_future(c.post("/v1/completions", headers=auth, json={
        "prompt": "hi", "max_tokens": 1, "n": 2}))
    for _ in range(100):
        if len(engine.held) == 2:
            break
        await asyncio.sleep(0.01)
    assert (await c.get("/load", headers=auth)).json() == {"server_load": 2}
    engine.release()
    assert (await task).status_code == 200
    assert (await c.get("/load", headers=auth)).json() == {"server_load": 0}
    engine.tm.dead = "the engine process exited with code 1"
    assert (await c.get("/ping")).status_code == 503


async def test_in_openapi(tok):
    c, _ = _app(tok)
    paths = (await c.get("/openapi.json")).json()["paths"]
    assert {"post"} <= set(paths["/invocations"]) and {"get", "post"} <= set(paths["/ping"])
    assert "get" in paths["/version"] and "get" in paths["/load"]
