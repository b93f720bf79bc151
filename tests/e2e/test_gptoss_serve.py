"""``ferry serve`` on a tiny gpt-oss checkpoint in the harmony format, with no parser flags:
the server picks ``--reasoning-parser gpt-oss`` and ``--tool-call-parser gpt-oss`` from the
architecture (and says so), renders prompts with the checkpoint's harmony chat template
(``reasoning_effort`` reaching it), stops on ``<|call|>`` and ``<|return|>``.

The checkpoint's greedy answer is scripted (``tests/engine/harmony_helpers.py``): reasoning
``ponder``, then a call ``get({"q": 1})`` in the commentary channel ending ``<|call|>``;
with the call's header token banned (``logit_bias``), a final answer ``Sure`` ending
``<|return|>``. Forced tool calls (named, ``required``) of functions it never calls itself,
on chat and Responses, stream and not: past its reasoning the tokens are drawn at random
under the harmony grammar, and the call is still valid. One server start-up for the module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from api_helpers import fold_chat_stream
from conftest import FerryServer

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

TOOLS = [{"type": "function", "function": {
    "name": "get", "description": "Look q up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "integer"}},
                   "required": ["q"]}}}]
MSG = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from harmony_helpers import CALL_HEAD, save_scripted_gptoss

    ckpt = tmp_path_factory.mktemp("scripted-gptoss")
    ids = save_scripted_gptoss(ckpt)
    server = FerryServer(tmp_path_factory.mktemp("ferry-gptoss"), [
        "--model-path", str(ckpt), "--device", "cpu", "--dtype", "float32",
        "--served-model-name", "oss", "--max-total-tokens", "2048"])
    server.start()
    try:
        yield server, ids[CALL_HEAD], ckpt
    finally:
        server.stop()


def _chat(srv, **body) -> dict:
    server = srv[0]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=server.http_timeout,
                   json=dict({"model": "oss", "messages": MSG, "max_tokens": 16,
                              "temperature": 0}, **body))
    assert r.status_code == 200, r.text
    return r.json()


def test_family_parsers_are_the_default_and_logged(srv):
    log = srv[0].log()
    assert "GptOssForCausalLM: defaulting to --reasoning-parser gpt-oss and " \
           "--tool-call-parser gpt-oss" in log


def test_tool_call_in_commentary_ends_the_turn(srv):
    body = _chat(srv, tools=TOOLS)
    choice = body["choices"][0]
    m = choice["message"]
    assert m["reasoning_content"] == "ponder"
    assert m["content"] is None
    assert [c["function"] for c in m["tool_calls"]] == [{"name": "get",
                                                         "arguments": '{"q": 1}'}]
    assert choice["finish_reason"] == "tool_calls"
    # <|channel|> analysis <|message|> ponder <|end|>
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 3
    assert body["usage"]["completion_tokens"] == 9          # ... <|call|> included


def test_stream_gives_the_same_message(srv):
    reasoning, content, calls, finish = fold_chat_stream(srv[0].url, {
        "model": "oss", "messages": MSG, "tools": TOOLS, "max_tokens": 16, "temperature": 0})
    assert (reasoning, content, calls, finish) == ("ponder", "", {0: ["get", '{"q": 1}']},
                                                   "tool_calls")


def test_final_channel_is_the_content_and_return_stops(srv):
    body = _chat(srv, tools=TOOLS, logit_bias={str(srv[1]): -100})
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == "ponder"
    assert choice["message"]["content"] == "Sure"
    assert "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_reasoning_effort_and_tool_history_reach_the_template(srv):
    """The prompt (one token a character) says ``Reasoning: high`` for ``reasoning_effort:
    high``, one character more than ``low`` (and as ``chat_template_kwargs`` says it); a
    conversation with the call and its result rendered back is longer still."""
    def prompt_len(**body) -> int:
        return _chat(srv, max_tokens=1, **body)["usage"]["prompt_tokens"]

    high = prompt_len(reasoning_effort="high")
    assert high == prompt_len(reasoning_effort="low") + 1
    assert high == prompt_len(chat_template_kwargs={"reasoning_effort": "high"})
    history = MSG + [{"role": "assistant", "content": None, "reasoning_content": "ponder",
                      "tool_calls": [{"id": "c1", "type": "function", "function": {
                          "name": "get", "arguments": '{"q": 1}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    with_history = prompt_len(messages=history, tools=TOOLS)
    # the analysis message, the call and the result, in harmony's framing
    rendered = ('<|start|>assistant<|channel|>analysis<|message|>ponder<|end|>'
                '<|start|>assistant to=functions.get<|channel|>commentary json<|message|>'
                '{"q": 1}<|call|><|start|>functions.get to=assistant<|channel|>commentary'
                '<|message|>"42"<|end|>')
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(srv[2]))
    assert with_history == prompt_len(tools=TOOLS) + len(
        tok.encode(rendered, add_special_tokens=False))


def test_responses_reasoning_item_then_call_with_effort(srv):
    """``/v1/responses``: the analysis channel as a reasoning item, the commentary call as
    a ``function_call`` item; ``reasoning.effort`` reaches the template (one character
    more for ``high`` than ``low``)."""
    server = srv[0]

    def respond(effort: str) -> dict:
        r = httpx.post(server.url + "/v1/responses", timeout=server.http_timeout, json={
            "model": "oss", "input": "hi", "max_output_tokens": 16, "temperature": 0,
            "reasoning": {"effort": effort},
            "tools": [{"type": "function", "name": "get",
                       "parameters": TOOLS[0]["function"]["parameters"]}]})
        assert r.status_code == 200, r.text
        return r.json()

    body = respond("high")
    assert [i["type"] for i in body["output"]] == ["reasoning", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "ponder"}]
    assert (body["output"][1]["name"], body["output"][1]["arguments"]) == ("get", '{"q": 1}')
    assert body["usage"]["input_tokens"] == respond("low")["usage"]["input_tokens"] + 1


def test_no_markup_and_stop_cut_calls(srv):
    """Without tools the commentary call is its body as content (no harmony markup); a stop
    string inside the arguments is no call, ``finish_reason: "stop"``; a forced tool call
    beside another output constraint is one 400 naming ``tool_choice``."""
    for body in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        m = _chat(srv, **body)["choices"][0]
        assert (m["message"]["content"], m["finish_reason"]) == ('{"q": 1}', "stop")
    choice = _chat(srv, tools=TOOLS, stop=['"q"'])["choices"][0]
    assert "tool_calls" not in choice["message"]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("{", "stop")
    server = srv[0]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=server.http_timeout,
                   json={"model": "oss", "messages": MSG, "max_tokens": 8, "tools": TOOLS,
                         "tool_choice": "required",
                         "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
          "required": ["city"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_constrains_the_answer_after_the_final_header(srv, stream):
    """``response_format`` with harmony: the reasoning runs free (``ponder``, which the
    schema would forbid), the answer after ``<|channel|>final<|message|>`` follows the
    schema (the scripted model's own answer, ``Sure``, does not) and the grammar's end
    stops it."""
    server = srv[0]
    body = {"model": "oss", "messages": MSG, "max_tokens": 48, "temperature": 0,
            "logit_bias": {str(srv[1]): -100}, "stream": stream,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "c", "schema": SCHEMA}}}
    reasoning, content, finish = "", "", None
    if stream:
        with httpx.stream("POST", server.url + "/v1/chat/completions",
                          timeout=server.http_timeout, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
    else:
        choice = _chat(srv, **body)["choices"][0]
        reasoning, content = choice["message"]["reasoning_content"], choice["message"]["content"]
        finish = choice["finish_reason"]
    assert reasoning == "ponder" and finish == "stop", (reasoning, content, finish)
    answer = json.loads(content)
    assert set(answer) == {"city"} and answer["city"] in ("Paris", "Rome"), content


#: tools whose calls the scripted model never writes (its own is ``get({"q": 1})``): under
#: the grammar it writes its reasoning (``ponder``), and each token past it is drawn at
#: random (``temperature`` 1: every token the grammar allows has the same logit), a random
#: model's output
PUT = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                        "warm": {"type": "boolean"}},
       "required": ["city", "warm"], "additionalProperties": False}
FLIP = {"type": "object", "properties": {"side": {"enum": ["heads", "tails"]}},
        "required": ["side"], "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}}
                for n, p in (("put", PUT), ("flip", FLIP))]
FORCED = {"model": "oss", "messages": MSG, "max_tokens": 200, "temperature": 1.0,
          "tools": FORCED_TOOLS}


def _valid_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "put":
        assert set(args) == {"city", "warm"} and args["city"] in ("Paris", "Rome")
        assert isinstance(args["warm"], bool)
    else:
        assert name == "flip" and args == {"side": args["side"]}
        assert args["side"] in ("heads", "tails")


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "put"}},
                                    "required"])
def test_forced_call_chat_stream_and_not(srv, choice):
    """A forced call with harmony (named, and ``required``: either tool) on
    ``/v1/chat/completions``: reasoning first, then one call of a forced function whose
    arguments match its schema, ``finish_reason: "tool_calls"``, stream and not."""
    names = set()
    for seed in (1, 2, 3):
        body = dict(FORCED, tool_choice=choice, seed=seed)
        choice_ = _chat(srv, **body)["choices"][0]
        m = choice_["message"]
        assert (m["reasoning_content"], m["content"], choice_["finish_reason"]) == (
            "ponder", None, "tool_calls"), choice_
        ((name, args),) = [(c["function"]["name"], c["function"]["arguments"])
                           for c in m["tool_calls"]]
        _valid_call(name, args)
        names.add(name)
        reasoning, content, calls, finish = fold_chat_stream(srv[0].url, body)
        assert (reasoning, content, finish) == ("ponder", "", "tool_calls")
        assert calls == {0: [name, args]}  # the same seed: the same call
    assert names == {"put"} or choice == "required"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_responses(srv, stream):
    """``/v1/responses`` with a named ``tool_choice`` (and ``required``): a reasoning item,
    then one ``function_call`` item of the forced function, its arguments valid."""
    server = srv[0]
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in FORCED_TOOLS]
    for choice in ({"type": "function", "name": "put"}, "required"):
        body = {"model": "oss", "input": "hi", "max_output_tokens": 200, "temperature": 1.0,
                "seed": 4, "tools": tools, "tool_choice": choice, "stream": stream}
        if not stream:
            r = httpx.post(server.url + "/v1/responses", timeout=server.http_timeout, json=body)
            assert r.status_code == 200, r.text
            out = r.json()["output"]
        else:
            out = None
            with httpx.stream("POST", server.url + "/v1/responses", json=body,
                              timeout=server.http_timeout) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if event["type"] == "response.completed":
                            out = event["response"]["output"]
        assert [i["type"] for i in out] == ["reasoning", "function_call"], out
        _valid_call(out[1]["name"], out[1]["arguments"])
        assert isinstance(choice, str) or out[1]["name"] == "put"
