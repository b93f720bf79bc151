"""Issue 28 item 4: vLLM's ``return_token_ids`` (``prompt_token_ids`` at the top of a chat
completion and in each completions choice, ``token_ids`` in each choice, streamed with
their chunks), through the official ``openai`` client over the app and a fake engine (every
request answers token 7, text "ok").

References: the HF tokenizer (the prompt's ids: ``encode``, the chat template), the fake
engine's ids.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from app_helpers import make_app

M = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "Count to three."}]


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


@pytest.fixture
def client(tok):
    app, engine = make_app()
    engine.tm.set_tokenizer(tok)
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", max_retries=0,
                              http_client=httpx.AsyncClient(
                                  transport=httpx.ASGITransport(app=app),
                                  base_url="http://t"))


def _chat_ids(tok) -> list[int]:
    out = tok.apply_chat_template(MSGS, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


async def test_completions_token_ids_per_choice(client, tok):
    r = await client.completions.create(model=M, prompt=["Hello there", "Bye"], max_tokens=1,
                                        n=2, extra_body={"return_token_ids": True})
    for i, ch in enumerate(r.choices):
        prompt = ["Hello there", "Bye"][i // 2]
        assert ch.model_extra["prompt_token_ids"] == tok.encode(prompt)
        assert ch.model_extra["token_ids"] == [7]
    plain = await client.completions.create(model=M, prompt="Hello", max_tokens=1)
    assert "token_ids" not in plain.choices[0].model_extra  # only when asked


async def test_chat_token_ids_top_level_prompt(client, tok):
    r = await client.chat.completions.create(model=M, messages=MSGS, max_tokens=1,
                                             extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == _chat_ids(tok)
    assert r.choices[0].model_extra["token_ids"] == [7]
    assert "prompt_token_ids" not in r.choices[0].model_extra


async def test_streams_carry_them_with_their_chunks(client, tok):
    stream = await client.chat.completions.create(
        model=M, messages=MSGS, max_tokens=1, stream=True,
        extra_body={"return_token_ids": True})
    chunks = [c async for c in stream]
    assert chunks[0].model_extra["prompt_token_ids"] == _chat_ids(tok)
    assert [t for c in chunks for ch in c.choices
            for t in (ch.model_extra or {}).get("token_ids") or []] == [7]
    stream = await client.completions.create(model=M, prompt="Hello there", max_tokens=1,
                                             stream=True,
                                             extra_body={"return_token_ids": True})
    chunks = [c async for c in stream]
    firsts = [ch.model_extra["prompt_token_ids"] for c in chunks for ch in c.choices
              if "prompt_token_ids" in (ch.model_extra or {})]
    assert firsts == [tok.encode("Hello there")]
    assert [t for c in chunks for ch in c.choices
            for t in (ch.model_extra or {}).get("token_ids") or []] == [7]


async def test_responses_take_it_at_its_default_only(client):
    r = await client.responses.create(model=M, input="hi",
                                      extra_body={"return_token_ids": False})
    assert r.status == "incomplete"  # served (the fake engine stops by length)
    with pytest.raises(openai.BadRequestError) as exc:
        await client.responses.create(model=M, input="hi",
                                      extra_body={"return_token_ids": True})
    assert exc.value.body["param"] == "return_token_ids"
