"""Request models: accepted shapes, bounds mapped to the offending ``param``, unsupported
fields, chat message rendering input, and the OpenAI error shape."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.sampling_params import SamplingParams
from server.app import model_name_of
from server.errors import APIError
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    messages_for_template,
    parse_request,
)


def comp(**kw):
    return parse_request(CompletionRequest, {"prompt": "hi", **kw})


def chat(messages=None, **kw):
    return parse_request(ChatCompletionRequest,
                         {"messages": messages or [{"role": "user", "content": "hi"}], **kw})


def param_of_error(fn, *a, **kw) -> str | None:
    with pytest.raises(APIError) as ei:
        fn(*a, **kw)
    assert ei.value.status == 400
    return ei.value.param


@pytest.mark.parametrize("prompt,expected", [
    ("x", "x"), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_shapes(prompt, expected):
    assert parse_request(CompletionRequest, {"prompt": prompt}).prompt == expected


@pytest.mark.parametrize("body", [{"prompt": []}, {"prompt": [1, "a"]}, {"prompt": 5},
                                  {"prompt": [[1], "a"]}, {}, {"prompt": None},
                                  {"prompt": [True]}])
def test_bad_prompts(body):
    assert param_of_error(parse_request, CompletionRequest, body) == "prompt"


@pytest.mark.parametrize("field,value", [
    ("temperature", 2.5), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0), ("repetition_penalty", 2.5), ("seed", 2**63),
    ("seed", -(2**63) - 1), ("max_tokens", 0), ("min_tokens", -1), ("n", 0), ("n", 10**6),
    ("stop", [""]), ("stop", ["x"] * 17), ("stop", "y" * 257), ("stop", [1]),
    ("stop_token_ids", [-1]), ("stop_token_ids", list(range(17))),
    ("logit_bias", {"a": 1}), ("logit_bias", {"1": 101}), ("logit_bias", {"1": "x"}),
    ("logit_bias", {str(i): 1 for i in range(1025)}), ("logit_bias", [1]),
    ("temperature", "hot"), ("stream", "maybe"), ("stream_options", 3), ("top_k", 2**31),
    ("min_tokens", 2**31), ("max_tokens", 2**31), ("min_p", -0.1),
])
def test_bounds_name_the_param(field, value):
    assert param_of_error(comp, **{field: value}) == field
    assert param_of_error(chat, **{field: value}) == field


def test_nan_is_refused():
    body = json.loads('{"prompt": "x", "temperature": NaN}')
    assert param_of_error(parse_request, CompletionRequest, body) == "temperature"


def test_null_means_absent_and_defaults():
    r = comp(temperature=None, stream_options=None, max_tokens=None, stop=None, n=None)
    assert r.temperature == 1.0 and r.stream_options is None and r.n == 1
    assert r.max_tokens == 16 and r.stop == []  # OpenAI's completions default
    assert not r.include_usage
    assert comp(stream=True, stream_options={"include_usage": True}).include_usage
    c = chat()
    assert c.requested_max_tokens is None  # chat: up to the context
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens == 7


def test_sampling_params_mapping():
    r = comp(temperature=0.3, top_p=0.8, top_k=5, min_p=0.05, seed=-7, stop="END",
             stop_token_ids=[3], ignore_eos=True, presence_penalty=0.1,
             frequency_penalty=0.2, repetition_penalty=1.3, logit_bias={"11": -5, "12": 100},
             min_tokens=2, skip_special_tokens=False, spaces_between_special_tokens=False)
    sp = r.sampling_params(r.max_tokens)
    assert sp == SamplingParams(max_tokens=16, min_tokens=2, temperature=0.3, top_p=0.8,
                                top_k=5, min_p=0.05, seed=-7, stop=["END"],
                                stop_token_ids=[3], ignore_eos=True, presence_penalty=0.1,
                                frequency_penalty=0.2, repetition_penalty=1.3,
                                logit_bias={11: -5.0, 12: 100.0}, skip_special_tokens=False,
                                spaces_between_special_tokens=False)
    sp.verify(49152)


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]), ("response_format", {"type": "json_object"}),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "x"}),
])
def test_unsupported_fields_name_themselves(field, value):
    assert param_of_error(chat, **{field: value}) == field


def test_harmless_fields_are_ignored():
    chat(user="u", metadata={"a": "b"}, store=False, parallel_tool_calls=True, tools=[],
         tool_choice="none", response_format={"type": "text"}, modalities=["text"],
         service_tier="auto", some_future_field=1, logprobs=False, top_logprobs=0,
         echo=False)
    comp(user="u", echo=False, best_of=1, suffix="")


def test_not_supported_yet():
    assert param_of_error(comp, best_of=3) == "best_of"
    assert param_of_error(comp, suffix="x") == "suffix"
    assert param_of_error(chat, echo=True) == "echo"  # completions only
    assert param_of_error(comp, logprobs=21) == "logprobs"  # out of bounds
    assert param_of_error(chat, top_logprobs=21, logprobs=True) == "top_logprobs"
    assert param_of_error(chat, top_logprobs=2) == "top_logprobs"  # needs logprobs: true


def test_logprobs_mapping():
    """completions logprobs=k -> k per generated token; echo adds k per prompt token; chat
    logprobs=true -> top_logprobs (0 when absent)."""
    assert comp().sampling_params(4).logprobs is None
    sp = comp(logprobs=3).sampling_params(4)
    assert (sp.logprobs, sp.prompt_logprobs) == (3, None)
    sp = comp(logprobs=0, echo=True).sampling_params(4)
    assert (sp.logprobs, sp.prompt_logprobs) == (0, 0)
    sp = comp(echo=True).sampling_params(4)
    assert (sp.logprobs, sp.prompt_logprobs) == (None, None)
    assert chat(logprobs=True).sampling_params(4).logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).sampling_params(4).logprobs == 5
    assert chat(logprobs=False, top_logprobs=0).sampling_params(4).logprobs is None
    assert chat().sampling_params(4).logprobs is None


def test_tokenize_bodies():
    r = parse_request(TokenizeRequest, {"prompt": "hi"})
    assert r.prompt == "hi" and r.messages is None and r.add_generation_prompt
    r = parse_request(TokenizeRequest, {"messages": [{"role": "user", "content": "x"}],
                                        "add_generation_prompt": False})
    assert r.prompt is None and not r.add_generation_prompt
    assert param_of_error(parse_request, TokenizeRequest, {}) == "prompt"
    assert param_of_error(parse_request, TokenizeRequest, {"prompt": 3}) == "prompt"
    assert param_of_error(parse_request, TokenizeRequest,
                          {"prompt": "a", "messages": [{"role": "user"}]}) == "prompt"
    assert parse_request(DetokenizeRequest, {"tokens": [1, 2]}).tokens == [1, 2]
    for bad in ({"tokens": ["a"]}, {"tokens": [1] * ((1 << 17) + 1)}, {}):
        assert param_of_error(parse_request, DetokenizeRequest, bad).startswith("tokens")


def test_messages_rendering_input():
    r = chat([{"role": "developer", "content": "be brief"},
              {"role": "user", "content": [{"type": "text", "text": "a"},
                                           {"type": "text", "text": "b"}]},
              {"role": "assistant", "content": None},
              {"role": "user", "content": "again"}])
    assert messages_for_template(r.messages) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}],
     "messages[1].role"),
    ([{"role": "tool", "content": "r", "tool_call_id": "1"}], "messages[0].role"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
])
def test_bad_messages(messages, param):
    r = chat(messages)
    assert param_of_error(messages_for_template, r.messages) == param


def test_message_shape_errors_name_the_path():
    assert param_of_error(parse_request, ChatCompletionRequest, {"messages": []}) == "messages"
    assert param_of_error(parse_request, ChatCompletionRequest,
                          {"messages": [{"content": "x"}]}) == "messages[0].role"
    assert param_of_error(parse_request, ChatCompletionRequest, {"messages": "hi"}) \
        == "messages"
    assert param_of_error(parse_request, ChatCompletionRequest, [1, 2]) is None


def test_error_shape():
    e = APIError("nope", 400, "temperature")
    assert e.body() == {"error": {"message": "nope", "type": "invalid_request_error",
                                  "param": "temperature", "code": None}}
    assert APIError("x", 503).body()["error"]["type"] == "service_unavailable"
    assert APIError("x", 401).body()["error"]["type"] == "authentication_error"
    assert e.sse().startswith("data: {") and e.sse().endswith("\n\n")
    assert json.loads(e.sse()[len("data: "):]) == e.body()


@pytest.mark.parametrize("path,served,name", [
    (None, None, "SmolLM2-135M-Instruct"),
    ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", None, "SmolLM2-135M-Instruct"),
    ("/m/qwen2.5-0.5b-instruct-q8_0.gguf", None, "qwen2.5-0.5b-instruct-q8_0"),
    ("/models/Llama-3.2-1B-Instruct/", None, "Llama-3.2-1B-Instruct"),
    ("/models/x", "my-model", "my-model"),
])
def test_model_name(path, served, name):
    assert model_name_of(SimpleNamespace(model_path=path, served_model_name=served)) == name
