"""Issue 28 on the real model (embedded SmolLM2, CPU, the shared server), through the official
``openai`` client: a stored Responses conversation continued by ``previous_response_id``,
``stop_regex``, ``return_token_ids``, SGLang's ``continue_final_message`` and
``/invocations``.

References: the HF tokenizer's chat template (prompts, token counts), Python's ``re`` on the
unstopped greedy text, the same request on the chat route.
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from api_helpers import HTTP_TIMEOUT_S, MODEL

pytestmark = pytest.mark.slow

COUNT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]


def _template(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_a_stored_conversation_continues(client, ref_tokenizer):
    r1 = client.responses.create(model=MODEL, input="My name is Ada. Say hello.",
                                 max_output_tokens=8, temperature=0)
    assert r1.store is True
    r2 = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8,
                                 temperature=0, previous_response_id=r1.id)
    convo = [{"role": "user", "content": "My name is Ada. Say hello."},
             {"role": "assistant", "content": r1.output_text},
             {"role": "user", "content": "What is my name?"}]
    assert r2.usage.input_tokens == len(_template(ref_tokenizer, convo,
                                                  add_generation_prompt=True))
    # the same conversation sent whole on the chat route gives the same greedy text
    chat = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=8,
                                          temperature=0)
    assert r2.output_text == chat.choices[0].message.content
    # the first turn's tokens came from the prefix cache
    assert r2.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(r2.id).output_text == r2.output_text
    client.responses.delete(r1.id)
    # a deleted (unknown) previous_response_id is OpenAI's 400 previous_response_not_found
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=r1.id)
    assert err.value.code == "previous_response_not_found"


def test_stop_regex_cuts_where_python_re_matches(client):
    plain = client.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=30,
                                           temperature=0, extra_body={"ignore_eos": True})
    text = plain.choices[0].message.content
    m = re.search(r"[4-6]", text)
    assert m is not None, text  # the reference text has a digit to stop at
    body = {"stop_regex": r"[4-6]"}
    r = client.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=30,
                                       temperature=0, extra_body=body)
    ch = r.choices[0]
    assert ch.message.content == text[:m.start()]
    assert ch.finish_reason == "stop" and ch.model_extra["matched_stop"] == r"[4-6]"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=COUNT, max_tokens=30, temperature=0, stream=True,
        extra_body=body) if c.choices)
    assert streamed == ch.message.content


def test_return_token_ids(client, ref_tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=6,
                                       temperature=0, extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == _template(ref_tokenizer, COUNT,
                                                          add_generation_prompt=True)
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == r.usage.completion_tokens
    assert ref_tokenizer.decode(ids, skip_special_tokens=True) == r.choices[0].message.content


def test_continue_final_message_alone(client, ref_tokenizer):
    msgs = [*COUNT, {"role": "assistant", "content": "1, 2,"}]
    sglang = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, temperature=0,
        extra_body={"continue_final_message": True, "return_token_ids": True})
    want = _template(ref_tokenizer, msgs, continue_final_message=True)
    assert sglang.model_extra["prompt_token_ids"] == want


def test_invocations(url):
    body = {"messages": COUNT, "max_tokens": 4, "temperature": 0}
    a = httpx.post(url + "/invocations", json=body, timeout=HTTP_TIMEOUT_S)
    b = httpx.post(url + "/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    assert httpx.post(url + "/ping", timeout=10).status_code == 200
