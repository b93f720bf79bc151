"""Structured-output request fields, tool-call plans and the auto tool-call parsers (no model:
the checks are against hand-written expectations and xgrammar's own grammar matching)."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.sampling.grammar import check_grammar
from engine.sampling.params import SamplingParams
from server.http.errors import APIError
from server.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from server.responses.input import chat_response_format
from server.tools.parsers import detect_parser, parse_tool_calls
from server.tools.plan import calls_schema, plan_tools, prepare_chat
from server.tools.structured import choice_grammar, constrain

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop"}}]


def _chat(**kw):
    return parse_request(ChatCompletionRequest, {"messages": MSGS, **kw})


def _constrain(req) -> SamplingParams:
    return asyncio.run(constrain(req, SamplingParams()))


def _param(fn, *a) -> str:
    with pytest.raises(APIError) as ei:
        fn(*a)
    assert ei.value.status == 400
    return ei.value.param


@pytest.mark.parametrize("body,kind,text", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer"}}}}, "json_schema", '{"type": "integer"}'),
    ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
    ({"guided_json": {"type": "integer"}}, "json_schema", '{"type": "integer"}'),
    ({"guided_json": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}'),
    ({"json_schema": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}'),
    ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"ebnf": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
    ({"guided_grammar": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
    ({"guided_choice": ["a", 'b"c']}, "ebnf", 'root ::= "a" | "b\\"c"'),
    ({"structured_outputs": {"regex": "[0-9]"}}, "regex", "[0-9]"),
    ({"structured_outputs": {"choice": ["x"]}}, "ebnf", 'root ::= "x"'),
])
def test_each_spelling_maps_onto_one_constraint(body, kind, text):
    sp = _constrain(_chat(**body))
    got = {k: getattr(sp, k) for k in ("json_schema", "regex", "ebnf") if getattr(sp, k)}
    assert got == {kind: text}


def test_text_format_and_no_constraint_leave_params_alone():
    assert _constrain(_chat(response_format={"type": "text"})) == SamplingParams()
    assert _constrain(parse_request(CompletionRequest, {"prompt": "x"})) == SamplingParams()


@pytest.mark.parametrize("body,param", [
    ({"regex": "a", "guided_json": {}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"regex": "(["}, "regex"),
    ({"ebnf": "root ::= nothing"}, "ebnf"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    # OpenAI's json_schema.name: required, ^[a-zA-Z0-9_-]{1,64}$
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, "response_format.json_schema.name"),
    *[({"response_format": {"type": "json_schema", "json_schema": {
        "name": bad, "schema": {"type": "object"}}}}, "response_format.json_schema.name")
      for bad in ("", "my schema", "a.b", "x" * 65, "a\n", "é", 3, ["a"])],
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs.json"),
    ({"structured_outputs": {"lark": "x"}}, "structured_outputs.lark"),
])
def test_bad_or_double_constraints_are_400s_naming_the_field(body, param):
    assert _param(lambda: _constrain(_chat(**body))) == param


def test_json_schema_object_missing_says_what_it_holds():
    """The 400 for a missing json_schema object names what is required ('name') and what
    is optional (OpenAI's 'schema' may be left out: any JSON object then)."""
    with pytest.raises(APIError) as ei:
        _constrain(_chat(response_format={"type": "json_schema"}))
    msg = ei.value.message
    assert "'name'" in msg and "optionally 'schema'" in msg, msg


@pytest.mark.parametrize("name", ["a", "x" * 64, "Person_v2-final", "0", "-_"])
def test_json_schema_names_of_openais_pattern_pass(name):
    sp = _constrain(_chat(response_format={"type": "json_schema", "json_schema": {
        "name": name, "schema": {"type": "integer"}}}))
    assert sp.json_schema == '{"type": "integer"}'
    assert chat_response_format({"format": {"type": "json_schema", "name": name, "schema": {
        "type": "integer"}}})["json_schema"]["name"] == name


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "schema": {"type": "object"}},
    *[{"type": "json_schema", "name": bad, "schema": {"type": "object"}}
      for bad in ("", "my schema", "x" * 65, "a/b", 1)]])
def test_responses_text_format_name_is_checked_the_same(fmt):
    assert _param(chat_response_format, {"format": fmt}) == "text.format.name"


def test_tools_are_refused_on_completions():
    req = parse_request(CompletionRequest, {"prompt": "x", "tools": TOOLS})
    assert _param(_constrain, req) == "tools"


def test_choice_grammar_matches_exactly_the_choices():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    g = xgr.Grammar.from_ebnf(choice_grammar(["yes", 'say "hi"', "a\\b", "é"], "c"))
    for s in ("yes", 'say "hi"', "a\\b", "é"):
        assert _is_grammar_accept_string(g, s), s
    for s in ("ye", "yes ", "no", ""):
        assert not _is_grammar_accept_string(g, s), s


def test_check_grammar_names_the_kind():
    check_grammar("regex", r"\d+")
    with pytest.raises(ValueError) as ei:
        check_grammar("regex", "(")
    assert ei.value.args[1] == "regex" and "invalid regex" in ei.value.args[0]


def test_verify_refuses_two_constraints():
    with pytest.raises(ValueError) as ei:
        SamplingParams(regex="a", ebnf='root ::= "a"').verify()
    assert ei.value.args[1] == "ebnf"


# ---- tools ---------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400s(body, param):
    assert _param(plan_tools, _chat(**body), None) == param


def _fn(params, strict=None, name="f"):
    fn = {"name": name, "parameters": params}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


@pytest.mark.parametrize("params, why", [
    ({"type": "object", "properties": "x"}, "properties"),
    ({"type": "object", "properties": [1, 2]}, "properties"),
    ({"type": "object", "properties": {"a": "string"}}, "properties.a"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"},
     "required"),
    ({"type": "object", "properties": {"a": {"type": 5}}}, "properties.a.type"),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, "properties.a.type"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": 5}}},
     "properties.a.items"),
    ({"type": "object", "properties": {"a": {"enum": "xy"}}}, "properties.a.enum"),
    ({"type": "object", "properties": {"a": {"anyOf": {"type": "string"}}}},
     "properties.a.anyOf"),
    ({"type": "object", "additionalProperties": 3}, "additionalProperties"),
])
def test_malformed_tool_schemas_name_the_tools_parameters(params, why):
    """Issue of the break-it trial: such schemas reached the chat template (gpt-oss's
    iterates ``properties``), whose error named ``messages``; with ``tool_choice`` forced,
    xgrammar's named ``tools``. Every choice names the tool's ``parameters``."""
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "f"}}):
        body = _chat(tools=[TOOLS[0], _fn(params)], tool_choice=choice)
        with pytest.raises(APIError) as ei:
            asyncio.run(prepare_chat(body, SamplingParams(), None))
        assert ei.value.param == "tools[1].function.parameters", (choice, ei.value.message)
        assert why in ei.value.message and "'f'" in ei.value.message, ei.value.message


@pytest.mark.parametrize("choice, strict, bad", [
    ("required", None, True), ({"type": "function", "function": {"name": "f"}}, None, True),
    ("auto", True, True), ("auto", None, False), ("none", True, True)])
def test_schemas_the_grammar_rejects_name_the_tool(choice, strict, bad):
    """A schema xgrammar cannot compile (a bad ``pattern``, a dangling ``$ref``) is a 400
    naming its tool's ``parameters`` when the schema is enforced (a forced call) or declared
    ``strict``; a non-strict tool under ``auto`` is only shown to the model."""
    for params in ({"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}},
                   {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}):
        body = _chat(tools=[TOOLS[0], _fn(params, strict)], tool_choice=choice)
        if not bad:
            asyncio.run(prepare_chat(body, SamplingParams(), None))
            continue
        with pytest.raises(APIError) as ei:
            asyncio.run(prepare_chat(body, SamplingParams(), None))
        assert ei.value.param == "tools[1].function.parameters", ei.value.message
        assert "'f'" in ei.value.message


def test_forced_tools_build_the_schema_and_refuse_a_second_constraint():
    plan, sp = asyncio.run(prepare_chat(_chat(tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False), SamplingParams(),
                                        None))
    assert json.loads(sp.json_schema) == calls_schema(plan.tools, False)
    assert json.loads(sp.json_schema)["maxItems"] == 1
    plan, sp = asyncio.run(prepare_chat(_chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), SamplingParams(), None))
    assert json.loads(sp.json_schema) == TOOLS[0]["function"]["parameters"]
    assert plan.choice == "named" and plan.template_kwargs == {"tools": plan.tools}
    with pytest.raises(APIError) as ei:
        asyncio.run(prepare_chat(_chat(tools=TOOLS, tool_choice="required", regex="a"),
                                 SamplingParams(), None))
    assert ei.value.param == "tool_choice"


def test_required_schema_accepts_calls_and_rejects_others():
    import jsonschema

    schema = calls_schema(plan_tools(_chat(tools=TOOLS), None).tools, True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}},
                         {"name": "noop", "parameters": {}}], schema)
    for bad in ([], [{"name": "other", "parameters": {}}],
                [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_auto_picks_the_parser_from_the_template():
    assert plan_tools(_chat(tools=TOOLS), "{{'<tool_call>'}}").parser == "hermes"
    assert plan_tools(_chat(tools=TOOLS), "x", "mistral").parser == "mistral"
    assert plan_tools(_chat(tools=TOOLS), "{{ messages }}").parser is None
    assert detect_parser("<|python_tag|>") == "llama3" and detect_parser(None) is None


# ---- parsers on real-format strings ---------------------------------------------------------

def _calls(parser, text):
    content, calls = parse_tool_calls(parser, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"tz": "CET"}}\n</tool_call>')
    assert _calls("hermes", text) == ("Let me check.", [("get_weather", {"city": "Paris"}),
                                                        ("get_time", {"tz": "CET"})])
    assert _calls("hermes", "Just text.") == ("Just text.", [])
    broken = '<tool_call>\n{"name": "f", "arguments": {'
    assert _calls("hermes", broken) == (broken, [])


def test_llama3():
    assert _calls("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}') == (
        None, [("get_weather", {"city": "Paris"})])
    two = ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
           '{"name": "b", "parameters": {}}')
    assert _calls("llama3", two) == (None, [("a", {"x": 1}), ("b", {})])
    assert _calls("llama3", 'Sure: <|python_tag|>{"name": "a", "parameters": {}}') == (
        "Sure:", [("a", {})])
    assert _calls("llama3", "The answer is {1}.") == ("The answer is {1}.", [])


def test_mistral_both_formats():
    v3 = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
          '{"name": "get_time", "arguments": {"tz": "CET"}}]')
    assert _calls("mistral", v3) == (None, [("get_weather", {"city": "Paris"}),
                                            ("get_time", {"tz": "CET"})])
    v11 = 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]noop[ARGS]{}'
    assert _calls("mistral", v11) == ("Checking.", [("get_weather", {"city": "Paris"}),
                                                    ("noop", {})])
    assert _calls("mistral", "no calls") == ("no calls", [])


# ---- the response writer --------------------------------------------------------------------

def _outputs(pieces: list[str], finish: str = "stop"):
    from server.tokenizer_manager import ReqOutput

    return [ReqOutput(0, p, [k], {"type": finish, "matched": None, "message": None}
                      if k == len(pieces) - 1 else None, 3, k + 1)
            for k, p in enumerate(pieces)]


def _assemble(chunks) -> tuple[str, list[dict], str | None]:
    content, calls, fin = "", {}, None
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                e = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                e["name"] += tc.get("function", {}).get("name") or ""
                e["arguments"] += tc.get("function", {}).get("arguments") or ""
            fin = ch["finish_reason"] or fin
    return content, [calls[i] for i in sorted(calls)], fin


@pytest.mark.parametrize("choice,parser,pieces,content,names", [
    ("auto", "hermes", ["Let me ", "check.<tool", "_call>\n{\"name\": \"get_weather\", ",
                        "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call><tool_call>",
                        "{\"name\": \"noop\", \"arguments\": {}}</tool_call>"],
     "Let me check.", ["get_weather", "noop"]),
    ("auto", "hermes", ["No ", "tools <tool", " needed."], "No tools <tool needed.", []),
    ("required", None, ['[{"name": "noop", ', '"parameters": {}}]'], "", ["noop"]),
    ("named", None, ['{"city": ', '"Paris"}'], "", ["get_weather"]),
])
def test_stream_assembles_to_the_full_body(choice, parser, pieces, content, names):
    from server.openai.tool_format import chat_format
    from server.tools.plan import ToolPlan

    plan = ToolPlan(tools=TOOLS, choice=choice, parser=parser,
                    name="get_weather" if choice == "named" else None)
    full = chat_format(plan, "c", "m", 1, 3, False).full([_outputs(pieces)])["choices"][0]
    f = chat_format(plan, "c", "m", 1, 3, False)
    chunks = f.start() + [c for o in _outputs(pieces) for c in f.chunks(o)]
    got_content, calls, fin = _assemble(chunks)
    msg = full["message"]
    assert [c["name"] for c in calls] == names
    assert [tc["function"]["name"] for tc in msg.get("tool_calls", [])] == names
    assert [c["arguments"] for c in calls] == [
        tc["function"]["arguments"] for tc in msg.get("tool_calls", [])]
    assert got_content == content and (msg["content"] or "") == content
    assert fin == full["finish_reason"] == ("tool_calls" if names else "stop")


def test_torch_mask_path_equals_xgrammars_kernel():
    import torch
    import xgrammar as xgr

    from engine.sampling.grammar import apply_vocab_mask, apply_vocab_mask_torch

    V = 100
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (V + 31) // 32), dtype=torch.int32,
                            generator=g)
    assert bitmask.shape == xgr.allocate_token_bitmask(3, V).shape
    x = torch.randn(3, V, generator=g)
    a, b = x.clone(), x.clone()
    apply_vocab_mask(a, bitmask, [0, 2])        # xgrammar's CPU kernel
    apply_vocab_mask_torch(b, bitmask, [0, 2])  # the accelerators' path
    assert torch.equal(a, b) and torch.equal(a[1], x[1])
    bits = [(int(bitmask[0, j // 32]) >> (j % 32)) & 1 for j in range(V)]
    assert [bool(v) for v in torch.isfinite(a[0]).tolist()] == [bool(t) for t in bits]


# ---- the grammar compile budget (issue 34 kind 3) -----------------------------------------

def test_a_compile_past_its_budget_rejects_the_request_with_a_400(monkeypatch):
    """A constraint whose compile outlives ``--grammar-compile-timeout`` ends its request
    (the engine loop answers a 400 naming the field kind and the limit); a failed compile
    likewise; a finished one goes to the waiting queue."""
    import time
    from concurrent.futures import Future

    from engine.scheduler.grammar_queue import GrammarQueue
    from engine.scheduler.request import Req

    class Backend:
        def __init__(self):
            self.futs = {}

        def submit(self, kind, text):
            return self.futs.setdefault((kind, text), Future())

    q = GrammarQueue(object(), 10, [0], budget_s=0.05)
    q.backend = Backend()
    slow = Req("slow", [1], SamplingParams(json_schema='{"type": "object"}'))
    bad = Req("bad", [1], SamplingParams(regex="a+"))
    ok = Req("ok", [1], SamplingParams(ebnf='root ::= "a"'))
    for r in (slow, bad, ok):
        assert q.add(r)
    ready, rejected = q.release(idle=True)  # waits IDLE_WAIT_S: nothing compiled yet
    assert len(q) == 3 and not ready and not rejected and not q.take_rejected()
    q.backend.futs[("regex", "a+")].set_exception(ValueError("invalid regex: nope", "regex"))
    q.backend.futs[("ebnf", 'root ::= "a"')].set_result(object())
    import engine.scheduler.grammar_queue as gq

    monkeypatch.setattr(gq, "GrammarState", lambda compiled: ("state", compiled))
    ready, rejected = q.release(idle=True)
    assert ready == [ok] and [(r.rid, m) for r, m in rejected] == [("bad", "invalid regex: nope")]
    assert len(q) == 1
    assert q.take_rejected() == {"bad": ("invalid regex: nope", "regex", "invalid_constraint")}
    time.sleep(0.06)
    ready, rejected = q.release(idle=False)
    assert not ready and [r.rid for r, _ in rejected] == ["slow"]
    rej = q.take_rejected()
    assert list(rej) == ["slow"] and not q.pending
    msg, param, code = rej["slow"]
    assert (param, code) == ("json_schema", "constraint_too_complex")
    assert "0.05 s" in msg and "--grammar-compile-timeout" in msg
    assert q.release(idle=True) == ([], [])
    assert q.take_rejected() == {}  # one release's rejections only


# ---- issue 34 kinds 4 and 6: forced calls cut short, hermes content, unknown functions -----

def _split(text: str, rng) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) \
        if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _both(choice, parser, pieces, finish="stop", matched=None):
    """(non-stream choice, streamed (content, calls, finish), stream chunks)."""
    from server.openai.tool_format import chat_format
    from server.tokenizer_manager import ReqOutput
    from server.tools.plan import ToolPlan

    def outs():
        return [ReqOutput(0, p, [k], {"type": finish, "matched": matched, "message": None}
                          if k == len(pieces) - 1 else None, 3, k + 1)
                for k, p in enumerate(pieces)]

    plan = ToolPlan(tools=TOOLS, choice=choice, parser=parser,
                    name="get_weather" if choice == "named" else None)
    full = chat_format(plan, "c", "m", 1, 3, False).full([outs()])["choices"][0]
    f = chat_format(plan, "c", "m", 1, 3, False)
    chunks = f.start() + [c for o in outs() for c in f.chunks(o)]
    return full, _assemble(chunks), chunks


def _same(full, streamed):
    content, calls, fin = streamed
    msg = full["message"]
    assert (msg["content"] or "") == content, (msg, streamed)
    assert [{"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
            for tc in msg.get("tool_calls") or []] == calls, (msg, streamed)
    assert full["finish_reason"] == fin


def test_forced_calls_cut_by_length_are_still_calls():
    """A named tool_choice cut by max_tokens came back as raw text in content without
    streaming and as tool_calls deltas with it; a cut "required" array as raw text (the
    README's tool_calls[0] raised). Both are calls with the arguments so far, "length"."""
    full, streamed, _ = _both("named", None, ['{"city": ', '"Par'], "length")
    assert full["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                            "arguments": '{"city": "Par'}
    assert full["message"]["content"] is None and full["finish_reason"] == "length"
    _same(full, streamed)
    text = '[{"name": "noop", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    full, streamed, _ = _both("required", None, [text[:20], text[20:]], "length")
    assert [(t["function"]["name"], t["function"]["arguments"])
            for t in full["message"]["tool_calls"]] == [("noop", "{}"),
                                                        ("get_weather", '{"ci')]
    _same(full, streamed)
    for cut, names in (('[{"name": "get_wea', []), ('[{"name": "noop"', ["noop"]),
                       ('[{"name": "noop", "param', ["noop"])):
        full, streamed, _ = _both("required", None, [cut], "length")
        assert [t["function"]["name"] for t in full["message"].get("tool_calls") or []] \
            == names
        _same(full, streamed)


@pytest.mark.parametrize("text,content,names", [
    # text after the last call was dropped
    ('A <tool_call>{"name": "noop", "arguments": {}}</tool_call> B', "A\nB", ["noop"]),
    ('<tool_call>{"name": "noop", "arguments": {}}</tool_call>\n<tool_call>{"name": "noop", '
     '"arguments": {}}</tool_call>\nDone.', "Done.", ["noop", "noop"]),
    # whitespace before a call is dropped, in streams too (it was streamed)
    ('Sure! \n<tool_call>{"name": "noop", "arguments": {}}</tool_call>', "Sure!", ["noop"]),
    ('\n\nSure<tool_call>{"name": "noop", "arguments": {}}', "\n\nSure", ["noop"]),
    # a call to a function not in tools is no call: the output is content
    ('Hm <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     'Hm <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "noop", "arguments": {}}</tool_call><tool_call>{"name": "x", '
     '"arguments": {}}</tool_call>', '<tool_call>{"name": "noop", "arguments": {}}'
     '</tool_call><tool_call>{"name": "x", "arguments": {}}</tool_call>', []),
])
def test_hermes_content_and_unknown_functions_stream_as_not(text, content, names):
    import random

    rng = random.Random(len(text))
    for _ in range(20):
        full, streamed, _ = _both("auto", "hermes", _split(text, rng))
        assert (full["message"]["content"] or "") == content
        assert [t["function"]["name"] for t in full["message"].get("tool_calls") or []] \
            == names
        _same(full, streamed)


def test_matched_stop_only_on_the_finishing_chunk():
    for choice, text in (("auto", 'x <tool_call>{"name": "noop", "arguments": {}}'),
                         ("required", '[{"name": "noop", "parameters": {}}]'),
                         ("named", '{"city": "Paris"}')):
        _, _, chunks = _both(choice, "hermes" if choice == "auto" else None, [text], "stop",
                             matched=2)
        marked = [c for c in chunks if "matched_stop" in c["choices"][0]]
        assert len(marked) == 1 and marked[0]["choices"][0]["finish_reason"], (choice, chunks)
        assert marked[0] is chunks[-1]


def test_fuzz_tool_outputs_stream_as_not():
    """Random hermes outputs (content, whitespace, calls, unknown names, broken JSON) and
    forced-call outputs cut anywhere, split into random stream messages: the assembled stream
    equals the non-stream body (content, calls, finish reason)."""
    import random

    rng = random.Random(34)
    parts = ["Sure.", " ", "\n", "ok <tool", 'x {"a": 1}',
             '<tool_call>{"name": "noop", "arguments": {}}</tool_call>',
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>', '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "noop", "argu']
    forced = {"required": '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                          '{"name": "noop", "parameters": {}}]',
              "named": '{"city": "Paris", "unit": "c"}'}
    for _ in range(300):
        choice = rng.choice(["auto", "auto", "required", "named"])
        if choice == "auto":
            text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 5)))
            finish = "stop"
        else:
            text = forced[choice]
            if rng.random() < 0.7:
                text, finish = text[:rng.randint(1, len(text) - 1)], "length"
            else:
                finish = "stop"
        full, streamed, chunks = _both(choice, "hermes" if choice == "auto" else None,
                                       _split(text, rng), finish)
        _same(full, streamed)
        assert sum("matched_stop" in c["choices"][0] for c in chunks) == 1


@pytest.mark.parametrize("schema,where", [
    ({"type": "object", "properties": {"user": {"type": "string",
                                                "pattern": "^(?!admin)[a-z]+$"}}},
     "schema.properties.user.pattern"),
    ({"type": "array", "items": {"type": "string", "pattern": "(?i)abc"}}, "schema.items.pattern"),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "(?=a)a"}]},
     "schema.anyOf[1].pattern"),
])
def test_schema_patterns_xgrammar_would_drop_are_refused(schema, where):
    """xgrammar's JSON-schema converter ignores a lookahead or an inline flag with only a
    warning: the output would break the schema, so the check refuses it, naming the place."""
    with pytest.raises(ValueError) as ei:
        check_grammar("json_schema", json.dumps(schema))
    assert where in ei.value.args[0]
    check_grammar("json_schema", json.dumps({"type": "string", "pattern": "^[a-z]+@x\\.com$"}))
