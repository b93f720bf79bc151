"""JSON held in strings never ends in a 5xx (reliability issue, kind 1).

Every request field whose string is parsed as JSON (schemas given as text in each
structured-output spelling, tool-call arguments of assistant messages, the Responses API's
``function_call`` arguments) and every object schema (tools' parameters) is fuzzed with
nested and malformed JSON; each answer must be a 2xx or a 400 naming the field, never a 5xx.
Deep nesting made ``json.loads`` raise ``RecursionError``, which the handlers' ``except
ValueError`` let through as a 500. Model output (tool-call parsers) falls back to content.
"""

from __future__ import annotations

import json
import random

import pytest
from app_helpers import make_app
from starlette.testclient import TestClient

from server.http import json_text
from server.tools.parsers import parse_tool_calls

MODEL = "SmolLM2-135M-Instruct"
LIMIT = json_text.MAX_JSON_DEPTH
USER = [{"role": "user", "content": "hi"}]


def nested(depth: int, kind: str = "array") -> str:
    """JSON text nested ``depth`` levels (1 = ``[]`` or ``{}``)."""
    if kind == "array":
        return "[" * depth + "]" * depth
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def fuzz_texts(seed: int = 0) -> list[str]:
    """Nested, truncated and junk JSON texts; includes depths far past Python's recursion
    limit (the original 500) and just past ferry's limit."""
    rng = random.Random(seed)
    texts = [nested(50_000), nested(5_000, "object"), nested(LIMIT + 1), nested(LIMIT + 1,
             "object"), "[" * 3000, '{"a":' * 3000, "", "{", "nul", "\ud800x", '"\\ud800"']
    for _ in range(12):
        d = rng.randint(1, 3 * LIMIT)
        t = nested(d, rng.choice(["array", "object"]))
        cut = rng.randint(0, len(t))
        texts.append(t[:cut] + rng.choice(["", "]", "}", ",", ":1", '"x"']) + t[cut:])
    return texts


# (route, body builder for a JSON text, the param the 400 must name)
def _chat(**kw):
    return "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": USER, **kw}


FIELDS = {
    "response_format.json_schema.schema": lambda t: _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": t}}),
    "guided_json": lambda t: _chat(guided_json=t),
    "json_schema": lambda t: _chat(json_schema=t),
    "structured_outputs.json": lambda t: _chat(structured_outputs={"json": t}),
    "messages[1].tool_calls[0].function.arguments": lambda t: _chat(messages=[
        USER[0], {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": t}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]),
    "input.function_call.arguments": lambda t: ("/v1/responses", {
        "model": MODEL, "max_output_tokens": 4, "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": t},
            {"type": "function_call_output", "call_id": "c1", "output": "x"}]}),
}


def post(client, route: str, body: dict):
    # json.dumps escapes lone surrogates (the test client's encoder refuses them)
    return client.post(route, content=json.dumps(body),
                       headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def client():
    app, _ = make_app()
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_json_text_fields_never_5xx(client, field):
    for text in fuzz_texts(seed=len(field)):
        route, body = FIELDS[field](text)
        r = post(client, route, body)
        assert r.status_code < 500, (field, text[:40], r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["type"] == "invalid_request_error", r.text[:300]


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_too_deep_is_a_400_naming_the_field(client, field):
    for text in (nested(50_000), nested(LIMIT + 1, "object")):
        route, body = FIELDS[field](text)
        r = post(client, route, body)
        assert r.status_code == 400, (field, r.text[:300])
        err = r.json()["error"]
        assert f"deeper than {LIMIT}" in err["message"], err
        assert err["param"] is not None


def test_depth_at_the_limit_is_accepted(client):
    # a valid schema nested exactly LIMIT levels is not refused for its depth
    schema = '{"type":"object","properties":{"a":' * (LIMIT // 2 - 1) + "{}" + "}}" * (LIMIT // 2 - 1)
    assert json_text.json_depth(json.loads(schema)) == LIMIT - 1
    for field in ("guided_json", "json_schema"):  # token ids: the fake engine has no tokenizer
        body = {"model": MODEL, "max_tokens": 4, "prompt": [1, 2, 3], field: schema}
        r = post(client, "/v1/completions", body)
        assert r.status_code == 200, r.text[:300]
    r = post(client, "/v1/completions", {"model": MODEL, "max_tokens": 4, "prompt": [1, 2, 3],
                                         "guided_json": '{"x":[' + schema + "]}"})
    assert r.status_code == 400 and "deeper" in r.text, r.text[:300]


def test_deep_tool_parameters_are_a_400(client):
    # built as text: the test client's own json.dumps cannot encode it
    deep = nested(LIMIT + 1, "object")[:-1] + ',"type":"object"}'
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "@"}}]})
    r = client.post("/v1/chat/completions", content=body.replace('"@"', deep),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "tools[0].function.parameters"


def test_json_depth_by_hand():
    assert json_text.json_depth(1) == 0
    assert json_text.json_depth([]) == 1
    assert json_text.json_depth({"a": [1, {"b": []}]}) == 4
    assert json_text.json_depth(json.loads(nested(500))) == 500


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_model_output_with_deep_json_is_content(parser):
    wrap = {"hermes": "<tool_call>{}</tool_call>", "llama3": "<|python_tag|>{}",
            "mistral": "[TOOL_CALLS]{}"}[parser]
    for body in (nested(50_000), '{"name": "f", "arguments": ' + nested(50_000) + "}",
                 '{"name": "f", "arguments": ' + nested(LIMIT + 1, "object") + "}"):
        text = wrap.replace("{}", body)
        content, calls = parse_tool_calls(parser, text)
        assert calls == [] and content == text
    # and a normal call still parses
    ok = wrap.replace("{}", '{"name": "f", "arguments": {"x": [1]}}')
    content, calls = parse_tool_calls(parser, ok)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": [1]})]
