"""OpenAI's Responses API (``POST /v1/responses``) end to end, through the official ``openai``
client and raw SSE (embedded SmolLM2, CPU, the shared server).

References: the same conversation sent to ``/v1/chat/completions`` at temperature 0 (text,
tool calls, token counts), the HF tokenizer's chat template (input tokens), hand-written
event orders, ``jsonschema`` (structured output). Never the endpoint's own output.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import pytest
from api_helpers import HTTP_TIMEOUT_S, MODEL, chat, post
from openai.types.responses import response_create_params
from pydantic import BaseModel

from server.http.errors import APIError
from server.openai.formats import ChatFormat
from server.responses.events import ResponseBuilder
from server.responses.request import parse_responses_request, to_chat
from server.tokenizer_manager import ReqOutput

pytestmark = pytest.mark.slow

RESP_ID = re.compile(r"resp_[0-9a-f]{48}")  # server-made, as OpenAI's: resp_ + 48 hex digits

Q = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather now",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "get_time", "description": "Time now",
          "parameters": {"type": "object", "properties": {"tz": {"type": "string",
                                                                 "maxLength": 10}},
                         "required": ["tz"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
              for t in TOOLS]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
TEXT_EVENTS_HEAD = ["response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added"]
TEXT_EVENTS_TAIL = ["response.output_text.done", "response.content_part.done",
                    "response.output_item.done"]


def raw_events(url: str, body: dict) -> list[dict]:
    """Every event of a streamed response; checks each ``event:`` line names its data."""
    events, name = [], None
    with httpx.stream("POST", url + "/v1/responses", json=dict(body, stream=True),
                      timeout=HTTP_TIMEOUT_S) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                e = json.loads(line[6:])
                assert e["type"] == name
                events.append(e)
    return events


def without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def test_text_equals_chat_and_usage(url, client, ref_tokenizer):
    msgs = [{"role": "system", "content": "You are concise."}, {"role": "user", "content": Q}]
    ref = chat(url, msgs, max_tokens=16)
    r = client.responses.create(model=MODEL, instructions="You are concise.", input=Q,
                                max_output_tokens=16, temperature=0)
    assert r.object == "response" and RESP_ID.fullmatch(r.id) and r.model == MODEL
    assert r.output_text == ref["choices"][0]["message"]["content"]
    assert len(r.output) == 1 and r.output[0].type == "message"
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    text = ref_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    prompt = ref_tokenizer.encode(text, add_special_tokens=False)
    assert r.usage.input_tokens == len(prompt) == ref["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == ref["usage"]["completion_tokens"]
    assert r.usage.total_tokens == len(prompt) + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0
    finish = ref["choices"][0]["finish_reason"]
    assert (r.status, r.output[0].status) == (("completed", "completed") if finish == "stop"
                                              else ("incomplete", "incomplete"))
    assert r.instructions == "You are concise." and r.temperature == 0
    assert r.max_output_tokens == 16 and r.tools == [] and r.error is None


def test_cut_by_length_is_incomplete(url, client):
    body = {"model": MODEL, "input": "Count from one to one hundred.", "max_output_tokens": 3,
            "temperature": 0, "ignore_eos": True}
    r = post(url, "/v1/responses", body).json()
    assert r["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["usage"]["output_tokens"] == 3 and r["output"][0]["status"] == "incomplete"
    events = raw_events(url, body)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == \
        r["output"][0]["content"][0]["text"]


def test_stream_event_order_and_text(url, client):
    body = {"model": MODEL, "input": Q, "max_output_tokens": 16, "temperature": 0}
    full = post(url, "/v1/responses", body).json()
    ref = chat(url, [{"role": "user", "content": Q}], max_tokens=16)
    events = raw_events(url, body)
    types = [e["type"] for e in events]
    k = types.count("response.output_text.delta")
    terminal = "response.completed" if full["status"] == "completed" else "response.incomplete"
    assert k >= 1
    assert types == TEXT_EVENTS_HEAD + ["response.output_text.delta"] * k + \
        TEXT_EVENTS_TAIL + [terminal]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == ref["choices"][0]["message"]["content"]
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events if "item_id" in e)
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == [] and events[0]["response"]["usage"] is None
    assert events[-4]["text"] == text and events[-3]["part"]["text"] == text
    final = events[-1]["response"]
    assert without_ids(final["output"]) == without_ids(full["output"])
    assert final["usage"]["output_tokens"] == full["usage"]["output_tokens"]
    assert final["output"][0]["id"] == item_id


def test_client_stream_helper_and_create_stream(client, url):
    ref = chat(url, [{"role": "user", "content": Q}], max_tokens=16)
    want = ref["choices"][0]["message"]["content"]
    assert ref["choices"][0]["finish_reason"] == "stop"  # else no response.completed
    deltas = []
    with client.responses.stream(model=MODEL, input=Q, max_output_tokens=16,
                                 temperature=0) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == want
    assert final.status == "completed"
    types = [e.type for e in client.responses.create(model=MODEL, input=Q, stream=True,
                                                     max_output_tokens=16, temperature=0)]
    assert types[:4] == TEXT_EVENTS_HEAD and types[-1] == "response.completed"


def test_input_items_equal_chat(url, client):
    msgs = [{"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another one?"}]
    ref = chat(url, [dict(m, role="system" if m["role"] == "developer" else m["role"])
                     for m in msgs], max_tokens=8)
    items = [{"type": "message", "role": m["role"], "content": [
        {"type": "output_text" if m["role"] == "assistant" else "input_text",
         "text": m["content"]}]} for m in msgs]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=8, temperature=0)
    assert r.output_text == ref["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == ref["usage"]["prompt_tokens"]
    easy = client.responses.create(model=MODEL, input=msgs, max_output_tokens=8,
                                   temperature=0)
    assert easy.output_text == r.output_text


def test_json_schema_and_json_object(url, client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    ask = "Describe a person as JSON."
    ref = chat(url, [{"role": "user", "content": ask}], max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                               "strict": True}})
    r = client.responses.create(model=MODEL, input=ask, text={"format": fmt},
                                max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.output_text == ref["choices"][0]["message"]["content"]
    assert r.text.format.type == "json_schema"
    obj = client.responses.create(model=MODEL, input=ask, max_output_tokens=40,
                                  text={"format": {"type": "json_object"}}, temperature=0)
    ref = chat(url, [{"role": "user", "content": ask}], max_tokens=40,
               response_format={"type": "json_object"})
    assert obj.output_text == ref["choices"][0]["message"]["content"]
    assert obj.output_text.lstrip().startswith("{")
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)

    class Person(BaseModel):
        name: str
        age: int

    parsed = client.responses.parse(model=MODEL, input=ask, text_format=Person,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Person)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_tool_calls_equal_chat(url, client, choice):
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat_choice = choice if isinstance(choice, str) else {
        "type": "function", "function": {"name": "get_weather"}}
    ref = chat(url, q, max_tokens=60, tools=CHAT_TOOLS, tool_choice=chat_choice)
    ref_calls = ref["choices"][0]["message"]["tool_calls"]
    r = client.responses.create(model=MODEL, input=q, tools=TOOLS, tool_choice=choice,
                                max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in ref_calls]
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    for c in calls:
        if c.name == "get_weather":
            jsonschema.validate(json.loads(c.arguments), WEATHER)
    assert r.status == "completed" and r.tools[0].name == "get_weather"
    # the stream: one function_call item per call, its argument deltas join to the same
    with client.responses.stream(model=MODEL, input=q, tools=TOOLS, tool_choice=choice,
                                 max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [a.type for a in added] == ["function_call"] * len(ref_calls)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(c["function"]["arguments"] for c in ref_calls)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [d.arguments for d in done] == [c["function"]["arguments"] for c in ref_calls]
    if choice != "required":
        assert final.output[0].parsed_arguments == json.loads(ref_calls[0]["function"]
                                                              ["arguments"])


def test_tool_round_trip_equals_chat(url, client):
    q = {"role": "user", "content": "What is the weather in Paris?"}
    args = '{"city": "Paris", "unit": "celsius"}'
    ref = chat(url, [q, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
        tools=CHAT_TOOLS, max_tokens=16)
    r = client.responses.create(model=MODEL, tools=TOOLS, max_output_tokens=16, temperature=0,
                                input=[q, {"type": "function_call", "call_id": "call_1",
                                           "name": "get_weather", "arguments": args},
                                       {"type": "function_call_output", "call_id": "call_1",
                                        "output": "sunny, 21 C"}])
    assert r.output_text == ref["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == ref["usage"]["prompt_tokens"]


def test_noops_change_nothing(url):
    body = {"model": MODEL, "input": Q, "max_output_tokens": 8, "temperature": 0}
    plain = post(url, "/v1/responses", body).json()
    extra = {"store": True, "metadata": {"k": "v"}, "user": "u1", "reasoning": {"effort":
             "low"}, "truncation": "disabled", "include": ["reasoning.encrypted_content"],
             "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "p",
             "parallel_tool_calls": True, "text": {"format": {"type": "text"},
                                                   "verbosity": "low"},
             "previous_response_id": None, "tool_choice": "auto"}
    r = post(url, "/v1/responses", dict(body, **extra))
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"] == plain["output"][0]["content"]
    assert r.json()["metadata"] == {"k": "v"} and r.json()["store"] is True


@pytest.mark.parametrize("extra,param,code", [
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"background": True, "stream": True}, "background", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]", "unsupported_parameter"),
    ({"max_tokens": 5}, "max_tokens", "unrecognized_field"),
    ({"messages": []}, "messages", "unrecognized_field"),
    ({"max_output_tokens": 0}, "max_output_tokens", None),
    ({"temperature": 2.5}, "temperature", None),
    ({"top_p": 0}, "top_p", None),
    ({"stream": "yes"}, "stream", None),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", None),
    ({"input": []}, "input", None),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].image_url", None),  # a text-only model
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].file_id", "unsupported_parameter"),
    # (a reasoning item of an earlier turn is accepted: tests/unit/test_reasoning_writers.py)
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type",
     "unsupported_parameter"),
    ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input[0].colour", None),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", None),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"text": {"format": {"type": "json_schema", "schema": PERSON}}}, "text.format.name",
     None),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "wat"}}}}}}, "text.format.schema", None),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", None),
    ({"max_output_tokens": 9000}, "max_output_tokens", "context_length_exceeded"),
    ({"input": "hi " * 9000}, "input", "context_length_exceeded"),
    ({"top_k": -5}, "top_k", None),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": PERSON,
                          "strict": "yes"}}}, "text.format.strict", None),
    ({"metadata": "x"}, "metadata", "invalid_type"),
    ({"user": 5}, "user", "invalid_type"),
    # issue 41: OpenAI's bounds (16 pairs, 64-character keys, 512-character values, ids of
    # 64 characters): a response must not pin megabytes of bookkeeping in the store
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata",
     "object_above_max_properties"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k", "string_above_max_length"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "string_above_max_length"),
    ({"user": "u" * 65}, "user", "string_above_max_length"),
    ({"safety_identifier": "s" * 65}, "safety_identifier", "string_above_max_length"),
    ({"prompt_cache_key": "p" * 65}, "prompt_cache_key", "string_above_max_length"),
])
def test_errors_name_the_field(url, extra, param, code):
    r = post(url, "/v1/responses", dict({"model": MODEL, "input": "hi",
                                         "max_output_tokens": 4}, **extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if code is not None:
        assert err["code"] == code, err


def test_bad_bodies(url):
    r = httpx.post(url + "/v1/responses", content=b'{"input": "hi", ',
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/responses", json={"input": "hi", "model": "gpt-4o"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.get(url + "/v1/responses", timeout=30)
    assert r.status_code == 405


def test_request_id_names_the_request_not_the_response(url):
    """``X-Request-Id`` names the request (echoed back, the engine's id, the logs); the
    response's id is the server's own (issue 41: a client id could replace a stored one)."""
    r = httpx.post(url + "/v1/responses", headers={"X-Request-Id": "my-resp-1"}, timeout=60,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200 and RESP_ID.fullmatch(r.json()["id"])
    assert r.headers["x-request-id"] == "my-resp-1"
    r = httpx.post(url + "/v1/responses", timeout=60,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 2})
    assert r.headers["x-request-id"] == r.json()["id"]  # no client id: the response's


def _settled(url: str, rid: str) -> dict:
    """``GET /v1/responses/{rid}`` once it is no longer queued or in progress."""
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while True:
        got = httpx.get(f"{url}/v1/responses/{rid}", timeout=30)
        assert got.status_code == 200, got.text
        if got.json()["status"] not in ("queued", "in_progress") or \
                time.monotonic() > deadline:
            return got.json()
        time.sleep(0.1)


def test_a_client_id_cannot_reach_another_clients_response(url):
    """Issue 41 item 2, black box: requests whose ``X-Request-Id`` and ``rid``/``request_id``
    body fields equal a stored background response's id get responses of their own; the
    first stays retrievable, unchanged (its settings, its input) and is not cancelled."""
    first = {"model": MODEL, "input": "Count from one to fifty in words.",
             "instructions": "first", "metadata": {"owner": "first"},
             "max_output_tokens": 48, "temperature": 0, "background": True}
    r1 = post(url, "/v1/responses", first).json()
    assert RESP_ID.fullmatch(r1["id"]) and r1["status"] == "queued"
    items = httpx.get(f"{url}/v1/responses/{r1['id']}/input_items", timeout=30).json()
    seconds = []
    for extra in ({}, {"rid": r1["id"]}, {"request_id": r1["id"]}):
        for background in (True, False):
            r = httpx.post(url + "/v1/responses", headers={"X-Request-Id": r1["id"]},
                           timeout=HTTP_TIMEOUT_S, json={
                               "model": MODEL, "input": "Say hi.", "instructions": "second",
                               "metadata": {"owner": "second"}, "max_output_tokens": 2,
                               "background": background, **extra})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == r1["id"]  # the client's id, echoed
            assert RESP_ID.fullmatch(r.json()["id"]) and r.json()["id"] != r1["id"]
            seconds.append(r.json()["id"])
    assert len(set(seconds)) == len(seconds)
    got = _settled(url, r1["id"])
    assert got["status"] in ("completed", "incomplete"), got  # never cancelled
    assert (got["id"], got["instructions"], got["metadata"], got["background"]) == \
        (r1["id"], "first", {"owner": "first"}, True)
    assert got["output"] and got["usage"]["output_tokens"] > 0
    assert httpx.get(f"{url}/v1/responses/{r1['id']}/input_items", timeout=30).json() == items
    for rid in seconds:
        assert _settled(url, rid)["metadata"] == {"owner": "second"}
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert re.search(r"^ferry:responses_store_items\{[^}]*\} [1-9]", metrics, re.M)
    assert re.search(r"^ferry:responses_store_bytes\{[^}]*\} [1-9]", metrics, re.M)


def test_chat_bounds_the_same_fields(url):
    """Issue 41: chat completions bound ``metadata`` and ``user`` as the Responses API."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for extra, param in (({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                         ({"metadata": {"k": "v" * 513}}, "metadata.k"),
                         ({"user": "u" * 65}, "user")):
        r = post(url, "/v1/chat/completions", dict(body, **extra))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = dict(body, metadata={f"k{i}": "v" * 512 for i in range(16)}, user="u" * 64)
    assert post(url, "/v1/chat/completions", ok).status_code == 200


# ---- every field of the official client's request: implemented, a no-op or a 400 ----------

#: decided by hand (a field the client gains fails the test until someone decides)
IMPLEMENTED = {"model": MODEL, "input": "hi", "instructions": "Be brief.",
               "max_output_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stream": True,
               "stream_options": {"include_obfuscation": False},
               "text": {"format": {"type": "json_object"}},
               "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
               "reasoning": {"effort": "low"}}
#: the stored-response fields (tests/unit/server/responses/test_responses_store.py)
STATE = {"previous_response_id": "resp_1", "background": True}
NOOPS = {"metadata": {"k": "v"}, "user": "u", "safety_identifier": "s",
         "prompt_cache_key": "k", "prompt_cache_retention": "24h", "service_tier": "auto",
         "store": True, "truncation": "disabled",
         "include": ["reasoning.encrypted_content"], "top_logprobs": 0}
REFUSED = {"truncation": "auto", "top_logprobs": 2,
           "include": ["message.output_text.logprobs"], "max_tool_calls": 3,
           "conversation": "conv_1",
           "prompt": {"id": "pmpt_1"}, "context_management": [{"type": "compaction"}],
           "moderation": {"model": "m"}, "access_programs": {"x": 1},
           "background_options": {"x": 1}, "image": {"x": 1},
           "prompt_cache_options": {"x": 1}}


def test_every_client_field_is_decided():
    fields = set(response_create_params.ResponseCreateParamsStreaming.__annotations__)
    assert fields == set(IMPLEMENTED) | set(NOOPS) | set(REFUSED) | set(STATE)
    body = dict(IMPLEMENTED)
    req = parse_responses_request(body)
    chat_body = to_chat(req).body  # hand-mapped: the chat request it must become
    assert chat_body["messages"] == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hi"}]
    assert (chat_body["max_completion_tokens"], chat_body["temperature"],
            chat_body["top_p"], chat_body["parallel_tool_calls"]) == (5, 0.5, 0.9, False)
    assert chat_body["response_format"] == {"type": "json_object"}
    assert chat_body["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert chat_body["tool_choice"] == "required"
    assert chat_body["tools"][0] == {"type": "function", "function": {
        "name": "get_weather", "description": "Weather now", "parameters": WEATHER,
        "strict": True}}
    assert to_chat(parse_responses_request(dict(body, **NOOPS))).body == chat_body
    for name, value in REFUSED.items():
        with pytest.raises(APIError) as exc:
            parse_responses_request({"input": "hi", name: value})
        assert exc.value.status == 400 and exc.value.param.split("[")[0] == name, \
            (name, exc.value)


def _builder() -> ResponseBuilder:
    return ResponseBuilder("resp-1", MODEL, ChatFormat("resp-1", MODEL, 1, 5, False), {})


@pytest.mark.parametrize("finish,status,terminal", [
    ({"type": "stop", "matched": 2}, "completed", "response.completed"),
    ({"type": "length", "matched": None}, "incomplete", "response.incomplete"),
    ({"type": "abort", "matched": None, "message": "shutting down"}, "failed",
     "response.failed")])
def test_builder_terminal_events(finish, status, terminal):
    b = _builder()
    events = b.start() + b.feed(ReqOutput(0, "Hel", [1], None, 5, 1)) + \
        b.feed(ReqOutput(0, "lo", [2], finish, 5, 2))
    assert [e["type"] for e in events] == TEXT_EVENTS_HEAD + [
        "response.output_text.delta"] * 2 + TEXT_EVENTS_TAIL + [terminal]
    assert [e["sequence_number"] for e in events] == list(range(10))
    final = events[-1]["response"]
    assert final["status"] == status and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {
        "cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7}
    assert final["output"][0]["status"] == ("completed" if status == "completed"
                                            else "incomplete")
    assert (final["error"] is None) == (status != "failed")
    assert final["incomplete_details"] == ({"reason": "max_output_tokens"}
                                           if status == "incomplete" else None)


def test_builder_error_mid_stream_and_empty_answer():
    b = _builder()
    events = b.start() + b.feed(ReqOutput(0, "Hi", [1], None, 5, 1))
    events += b.fail(APIError("the engine is not running", 503))
    types = [e["type"] for e in events]
    assert types[-5:] == ["error"] + TEXT_EVENTS_TAIL + ["response.failed"]
    assert events[-5]["message"] == "the engine is not running"
    assert events[-1]["response"]["status"] == "failed"
    empty = _builder()
    events = empty.start() + empty.feed(ReqOutput(0, "", [2], {"type": "stop"}, 5, 1))
    assert [e["type"] for e in events] == TEXT_EVENTS_HEAD + TEXT_EVENTS_TAIL + [
        "response.completed"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_response_objects_validate_against_the_sdk_types():
    """Issue 34 kind 7: usage lacked input_tokens_details.cache_write_tokens, which the
    ``openai`` SDK's ``ResponseUsage`` declares required; the whole response object (text,
    tool calls, cut by length) validates against the SDK's ``Response`` model, strictly."""
    from openai.types.responses import Response

    from server.openai.tool_format import chat_format
    from server.tools.plan import ToolPlan

    echo = {"instructions": None, "temperature": 1.0, "top_p": 1.0, "tools": [],
            "tool_choice": "auto", "parallel_tool_calls": True, "metadata": {},
            "text": {"format": {"type": "text"}}, "max_output_tokens": None}
    plan = ToolPlan(tools=[{"type": "function", "function": {"name": "f"}}], choice="named",
                    name="f")
    for fmt, pieces, finish in (
            (ChatFormat("r", MODEL, 1, 5, False), ["Hel", "lo"], {"type": "stop"}),
            (ChatFormat("r", MODEL, 1, 5, False), ["Hel"], {"type": "length"}),
            (chat_format(plan, "r", MODEL, 1, 5, False), ['{"a": ', "1}"], {"type": "stop"})):
        b = ResponseBuilder("resp-1", MODEL, fmt, echo)
        events = b.start()
        for k, p in enumerate(pieces):
            events += b.feed(ReqOutput(0, p, [k], finish if k == len(pieces) - 1 else None,
                                       5, k + 1))
        Response.model_validate(events[-1]["response"], strict=False)
        assert events[-1]["response"]["usage"]["input_tokens_details"][
            "cache_write_tokens"] == 0
