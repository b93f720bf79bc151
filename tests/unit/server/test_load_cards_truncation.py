"""Small API gaps clients hit, over a fake engine: ``/get_load`` per data-parallel replica,
``GET /v1/models/{base}:{adapter}``, vLLM's ``truncate_prompt_tokens``/``truncation_side``,
the unknown-role error listing every role, and vLLM's null ``prompt_logprobs``."""

from __future__ import annotations

import httpx
import pytest
from app_helpers import make_app

from engine import io_struct as io
from server.openai import native

M = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(None)


async def _call(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        return await c.request(method, path, json=body)


def test_get_load_has_one_entry_per_replica():
    infos = [(0, io.ServerInfoOut(rid="a", kv_used_tokens=5, kv_free_tokens=1,
                                  kv_total_tokens=6, num_running=2, num_waiting=1)),
             (2, io.ServerInfoOut(rid="b", kv_used_tokens=0, kv_free_tokens=6,
                                  kv_total_tokens=6, num_running=0, num_waiting=0))]
    assert native.load_of(infos) == [
        {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 5},
        {"dp_rank": 2, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


async def test_model_card_of_base_colon_adapter():
    app, engine = make_app()
    engine.tm.lora_adapters = {"sql": "/a/sql"}
    r = await _call(app, "GET", f"/v1/models/{M}:sql")
    assert r.status_code == 200
    assert r.json()["id"] == f"{M}:sql" and r.json()["parent"] == M
    assert (await _call(app, "GET", "/v1/models/sql")).json()["id"] == "sql"
    assert (await _call(app, "GET", f"/v1/models/{M}:nope")).status_code == 404


@pytest.mark.parametrize("side, keep", [(None, "last"), ("left", "last"),
                                        ("right", "first")])
async def test_truncate_prompt_tokens(tok, side, keep):
    app, engine = make_app()
    engine.tm.set_tokenizer(tok)
    ids = list(range(100, 120))
    body = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 5,
            "return_token_ids": True, **({"truncation_side": side} if side else {})}
    r = await _call(app, "POST", "/v1/completions", body)
    assert r.status_code == 200, r.text
    kept = ids[-5:] if keep == "last" else ids[:5]
    assert engine.sent[-1].input_ids == kept
    assert r.json()["choices"][0]["prompt_token_ids"] == kept
    # chat: the rendered prompt is cut the same way
    r = await _call(app, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1,
        "truncate_prompt_tokens": 3, **({"truncation_side": side} if side else {})})
    assert r.status_code == 200 and len(engine.sent[-1].input_ids) == 3


async def test_truncate_prompt_tokens_bounds(tok):
    app, engine = make_app()
    engine.tm.set_tokenizer(tok)
    for value, status in ((0, 400), (-2, 400), (-1, 200)):
        r = await _call(app, "POST", "/v1/completions", {
            "prompt": [1, 2, 3], "max_tokens": 1, "truncate_prompt_tokens": value})
        assert r.status_code == status, (value, r.text)
    r = await _call(app, "POST", "/v1/completions", {
        "prompt": [1, 2, 3], "max_tokens": 1, "truncation_side": "middle"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"


async def test_unknown_role_lists_every_role(tok):
    app, engine = make_app()
    engine.tm.set_tokenizer(tok)
    r = await _call(app, "POST", "/v1/chat/completions", {
        "messages": [{"role": "wizard", "content": "x"}], "max_tokens": 1})
    assert r.status_code == 400
    for role in ("system", "developer", "user", "assistant", "tool"):
        assert f"'{role}'" in r.json()["error"]["message"]


async def test_prompt_logprobs_is_null_where_vllm_puts_it(tok):
    """vLLM's bodies carry ``prompt_logprobs`` even when it was not asked for: null on every
    completions choice and at the top of a chat completion; asked for, it is the list."""
    app, engine = make_app()
    engine.tm.set_tokenizer(tok)
    r = await _call(app, "POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1,
                                                     "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all("prompt_logprobs" in c and c["prompt_logprobs"] is None
                                     for c in choices)
    r = await _call(app, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    body = r.json()
    assert r.status_code == 200 and "prompt_logprobs" in body and body["prompt_logprobs"] is None
    assert "prompt_logprobs" not in body["choices"][0]
