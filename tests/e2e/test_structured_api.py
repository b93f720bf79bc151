"""Structured output and tool calling end to end (embedded SmolLM2, CPU, one shared server).

Every constrained output must parse and validate with ``jsonschema`` / ``re.fullmatch``;
free requests sent beside constrained ones must equal their outputs alone; tool calls come
back through the official ``openai`` client and their arguments validate against the tool's
``parameters``; bad constraints are 400s naming the field.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import httpx
import jsonschema
import pytest
from api_helpers import HTTP_TIMEOUT_S, MODEL, chat, comp, post, stream_chunks

from bench.grammar.grammar_cases import PERSON, TIME_TZ, WEATHER

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time now",
                                           "parameters": TIME_TZ}}]
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def _rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("temperature,seed", [(0, None), (1.0, 11)])
def test_response_format_validates_stream_and_not(url, temperature, seed):
    body = {"response_format": _rf(PERSON), "max_tokens": 80, "temperature": temperature,
            "seed": seed}
    r = chat(url, ASK, **body)
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), PERSON)
    assert r["choices"][0]["finish_reason"] == "stop"
    chunks = stream_chunks(url, "/v1/chat/completions",
                           {"model": MODEL, "messages": ASK, **body})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])
    jsonschema.validate(json.loads(text), PERSON)
    if seed is not None or temperature == 0:
        assert text == r["choices"][0]["message"]["content"]


def test_every_field_spelling_constrains(url):
    phone = r"\d{3}-\d{4}"
    for extra in ({"regex": phone}, {"guided_regex": phone},
                  {"structured_outputs": {"regex": phone}}):
        out = comp(url, "Call me at", max_tokens=20, **extra)["choices"][0]
        assert re.fullmatch(phone, out["text"]), (extra, out)
    for extra in ({"guided_choice": ["red", "green"]},
                  {"ebnf": 'root ::= "red" | "green"'},
                  {"guided_grammar": 'root ::= "red" | "green"'}):
        out = chat(url, ASK, max_tokens=10, **extra)["choices"][0]["message"]["content"]
        assert out in ("red", "green"), (extra, out)
    for extra in ({"json_schema": json.dumps(PERSON)}, {"guided_json": PERSON}):
        out = chat(url, ASK, max_tokens=80, **extra)["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(out), PERSON)
    # any object: the small model may not close it within max_tokens; what it wrote must be
    # the start of one, and a "stop" must be a whole one
    ch = chat(url, [{"role": "user", "content": "Reply with a JSON object with one key."}],
              max_tokens=120, response_format={"type": "json_object"})["choices"][0]
    text = ch["message"]["content"]
    assert text.startswith("{")
    if ch["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_free_requests_beside_constrained_ones_are_unchanged(url):
    free = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 1.0,
            "seed": 5}
    alone = comp(url, **free)["choices"][0]["text"]
    with cf.ThreadPoolExecutor(4) as ex:
        cons = [ex.submit(chat, url, ASK, response_format=_rf(PERSON), max_tokens=80,
                          temperature=1.0, seed=s) for s in (1, 2, 3)]
        frees = [ex.submit(comp, url, **free) for _ in range(2)]
        for f in cons:
            jsonschema.validate(json.loads(f.result()["choices"][0]["message"]["content"]),
                                PERSON)
        assert [f.result()["choices"][0]["text"] for f in frees] == [alone, alone]


def test_n_samples_all_validate(url):
    r = chat(url, ASK, n=3, response_format=_rf(PERSON), max_tokens=80, temperature=1.0,
             seed=3, logprobs=True, top_logprobs=1)
    assert len(r["choices"]) == 3
    for ch in r["choices"]:
        jsonschema.validate(json.loads(ch["message"]["content"]), PERSON)
        assert ch["logprobs"]["content"]


@pytest.mark.parametrize("body,param", [
    ({"response_format": _rf({"type": "nonsense"})}, "response_format.json_schema.schema"),
    ({"regex": "(["}, "regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"regex": "a", "guided_json": {"type": "object"}}, "guided_json"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(url, body, param):
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def _args_ok(call) -> dict:
    tool = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool[call.function.name])
    return args


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_validate_and_stream_assembles_the_same(client, choice):
    kw = dict(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice=choice,
              max_tokens=80, temperature=0)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    for call in msg.tool_calls:
        assert call.type == "function" and call.id
        _args_ok(call)
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    calls, fin = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                e = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                e["name"] += (tc.function.name or "") if tc.function else ""
                e["arguments"] += (tc.function.arguments or "") if tc.function else ""
            fin = ch.finish_reason or fin
    assert fin == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls]


def test_two_round_tool_conversation(client):
    first = client.chat.completions.create(
        model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice="required", max_tokens=80,
        temperature=0, parallel_tool_calls=False)
    calls = first.choices[0].message.tool_calls
    assert len(calls) == 1
    msgs = WEATHER_Q + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                            max_tokens=20, temperature=0)
    assert second.choices[0].message.content
    assert second.choices[0].finish_reason in ("stop", "length")


def test_tools_on_completions_is_refused(url):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                  "tools": TOOLS}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_that_ends_before_min_tokens_finishes_stop(url, stream):
    """Issue 34 kind 2: a grammar whose only continuation is EOS and a ``min_tokens`` that
    bans EOS left nothing to draw: finish "abort" with a garbage token in usage (and a
    server_error on /v1/responses). The grammar ends the output before min_tokens."""
    body = {"model": MODEL, "messages": ASK, "guided_choice": ["yes"], "min_tokens": 8,
            "max_tokens": 16, "temperature": 0}
    free = chat(url, ASK, guided_choice=["yes"], max_tokens=16)  # the same tokens, EOS too
    want = free["usage"]["completion_tokens"]
    if stream:
        chunks = stream_chunks(url, "/v1/chat/completions",
                               dict(body, stream_options={"include_usage": True}))
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        fin = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        usage = chunks[-1]["usage"]
    else:
        r = chat(url, **{k: v for k, v in body.items() if k not in ("model",)})
        text, fin = r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]
        usage = r["usage"]
    assert (text, fin, usage["completion_tokens"]) == ("yes", "stop", want)
    r = post(url, "/v1/responses", {"model": MODEL, "input": "Say yes.", "regex": "yes",
                                    "min_tokens": 8, "max_output_tokens": 16,
                                    "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed", r.text
    assert body["output"][0]["content"][0]["text"] == "yes", r.text
