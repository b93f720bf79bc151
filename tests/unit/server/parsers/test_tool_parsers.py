"""The ``--tool-call-parser`` families (server/parsers/): each against its family's
documented format (one call, several, text around them, malformed and cut output), and
their streams: split anywhere (in two at every character, or char by char), a stream sums to
the non-stream parse."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.args import TOOL_CALL_PARSERS, ServerArgs
from server.parsers.base import ArgsDelta, CallStart, ContentDelta
from server.parsers.tool_registry import (
    TOOL_PARSER_ALIASES,
    TOOL_PARSERS,
    canonical_tool_parser,
    detect_tool_parser,
    get_tool_parser,
    tool_parser_names,
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "ratio": {"type": "number"},
        "opts": {"type": "object"}, "tags": {"type": "array"}, "code": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]

# ---- the families' documented strings: (parser, text, content, [(name, args)]) -----------
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
K_BEGIN, K_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_CALL_END = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                              "<|tool_call_end|>")
PARIS = {"city": "Paris"}


def _ds3(name, args):
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


def _ds31(name, args):
    return f"{DS_CALL}{name}{DS_SEP}{args}{DS_CALL_END}"


def _kimi(name, idx, args):
    return f"{K_CALL}functions.{name}:{idx}{K_ARGS}{args}{K_CALL_END}"


def _qc(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _glm(name, **params):
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                   for k, v in params.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


def _oss(name, args, start=True):
    head = "<|start|>assistant" if start else ""
    return (f"{head}<|channel|>commentary to=functions.{name} <|constrain|>json"
            f"<|message|>{args}<|call|>")


CASES = [
    # hermes (Qwen 2.5/3)
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", PARIS), ("noop", {})]),
    ("hermes", '<tool_call>\n{"name": "noop", "arguments": {}}', None, [("noop", {})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {', '<tool_call>\n{"name": "f", '
     '"arguments": {', []),
    ("hermes", "No tools <tool needed.", "No tools <tool needed.", []),
    # llama3
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", PARIS)]),
    ("llama3", 'Sure: <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", '
     '"parameters": {"x": 1}}', "Sure:", [("a", {}), ("b", {"x": 1})]),
    ("llama3", "The answer is {1}.", "The answer is {1}.", []),
    # mistral, both forms
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "noop", "arguments": {}}]', None, [("get_weather", PARIS), ("noop", {})]),
    ("mistral", 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]noop'
     '[ARGS]{}', "Checking.", [("get_weather", PARIS), ("noop", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": ', '[TOOL_CALLS]get_weather[ARGS]'
     '{"city": ', []),
    # pythonic (Llama 4)
    ("pythonic", '[get_weather(city="Paris", days=3), noop()]', None,
     [("get_weather", {"city": "Paris", "days": 3}), ("noop", {})]),
    ("pythonic", 'Sure. <|python_start|>[get_weather(city="Paris", opts={"a": [1, true]})]'
     '<|python_end|> Done.', "Sure.\nDone.",
     [("get_weather", {"city": "Paris", "opts": {"a": [1, True]}})]),
    ("pythonic", "See [1] and [note](x).", "See [1] and [note](x).", []),
    ("pythonic", '[get_weather(city=__import__("os").getcwd())]',
     '[get_weather(city=__import__("os").getcwd())]', []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    # qwen3_coder
    ("qwen3_coder", "Let me check.\n" + _qc("get_weather", city="Paris", days="3") + "\n"
     + _qc("noop") + "\nDone.", "Let me check.\nDone.",
     [("get_weather", {"city": "Paris", "days": 3}), ("noop", {})]),
    ("qwen3_coder", _qc("get_weather", city="Paris", days="3")[:-40], None,
     [("get_weather", PARIS)]),
    ("qwen3_coder", "<tool_call>\n<function=get_wea", "<tool_call>\n<function=get_wea", []),
    ("qwen3_coder", "<tool_call>junk</tool_call> hi", "<tool_call>junk</tool_call> hi", []),
    # deepseekv3
    ("deepseekv3", "Sure." + DS_BEGIN + _ds3("get_weather", '{"city": "Paris"}') + "\n"
     + _ds3("noop", "{}") + DS_END, "Sure.", [("get_weather", PARIS), ("noop", {})]),
    ("deepseekv3", DS_BEGIN + f'{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Pa',
     None,
     [("get_weather", None)]),
    ("deepseekv3", "Plain answer.", "Plain answer.", []),
    # deepseekv31
    ("deepseekv31", DS_BEGIN + _ds31("get_weather", '{"city": "Tokyo"}')
     + _ds31("get_weather", '{"city": "Paris"}') + DS_END + " After.", "After.",
     [("get_weather", {"city": "Tokyo"}), ("get_weather", PARIS)]),
    ("deepseekv31", "Hmm " + DS_BEGIN + DS_CALL + "get_wea", "Hmm " + DS_BEGIN + DS_CALL
     + "get_wea", []),
    # kimi_k2
    ("kimi_k2", "I'll check. " + K_BEGIN + _kimi("get_weather", 0, '{"city": "Paris"}')
     + _kimi("noop", 1, "{}") + K_END, "I'll check.",
     [("get_weather", PARIS), ("noop", {})]),
    ("kimi_k2", K_BEGIN + _kimi("get_weather", 0, '{"city": "Pa')[:-len(K_CALL_END)], None,
     [("get_weather", None)]),
    ("kimi_k2", K_BEGIN + "\n" + K_CALL + "\nfunctions.get_weather:0" + K_ARGS
     + '\n{"city": "Paris"}\n' + K_CALL_END + "\n" + K_END, None, [("get_weather", PARIS)]),
    # glm45
    ("glm45", "Checking.\n" + _glm("get_weather", city="北京", days="2") + "\n"
     + _glm("noop"), "Checking.", [("get_weather", {"city": "北京", "days": 2}),
                                   ("noop", {})]),
    ("glm45", "<tool_call>noop</tool_call>", None, [("noop", {})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", None,
     [("get_weather", {})]),
    # gpt-oss (harmony)
    ("gpt-oss", "<|channel|>analysis<|message|>Need the weather.<|end|>"
     + _oss("get_weather", '{"city":"Paris"}'), None, [("get_weather", PARIS)]),
    ("gpt-oss", _oss("get_weather", '{"city":"Paris"}', start=False)
     + _oss("noop", "{}"), None, [("get_weather", PARIS), ("noop", {})]),
    ("gpt-oss", "<|channel|>commentary<|message|>Let me look.<|end|>"
     + _oss("get_weather", '{"city":"Paris"}'), "Let me look.", [("get_weather", PARIS)]),
    ("gpt-oss", "<|channel|>final<|message|>It is sunny.<|return|>",
     "<|channel|>final<|message|>It is sunny.<|return|>", []),
    ("gpt-oss", "It is sunny." + _oss("noop", "{}"), "It is sunny.", [("noop", {})]),
]


def _normal(calls):
    """Arguments decoded where they are whole JSON (None: a cut call's partial text)."""
    out = []
    for c in calls:
        name, args = (c.name, c.arguments) if hasattr(c, "name") else c
        try:
            out.append((name, json.loads(args)))
        except json.JSONDecodeError:
            out.append((name, None))
    return out


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parse_documented_format(parser, text, content, calls):
    got_content, got_calls = get_tool_parser(parser).parse(text, TOOLS)
    assert got_content == content
    assert _normal(got_calls) == calls


def _run(parser, pieces):
    stream = get_tool_parser(parser).stream(TOOLS)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    content, calls = "", {}
    for e in events:
        if isinstance(e, ContentDelta):
            assert e.text
            content += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(calls) and e.name
            calls[e.index] = [e.name, ""]
        else:
            assert isinstance(e, ArgsDelta) and e.index in calls and e.text
            calls[e.index][1] += e.text
    assert stream.result() == (content or None, [c for c in _as_calls(calls)])
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


def _as_calls(calls):
    from server.parsers.base import ParsedCall

    return [ParsedCall(*calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_stream_split_anywhere_equals_parse(parser, text, content, calls):
    c, cs = get_tool_parser(parser).parse(text, TOOLS)
    want = (c, [(x.name, x.arguments) for x in cs])
    for k in range(len(text) + 1):
        assert _run(parser, [text[:k], text[k:]]) == want, k
    assert _run(parser, list(text)) == want


def test_streaming_families_send_calls_and_arguments_as_they_come():
    text = ("Sure." + DS_BEGIN + _ds31("get_weather", '{"city": "Paris", "days": 3}')
            + DS_END)
    stream = get_tool_parser("deepseekv31").stream()
    seen = []
    for ch in text:
        seen.append(stream.feed(ch))
    flat = [e for evs in seen for e in evs]
    start = next(i for i, evs in enumerate(seen) if any(isinstance(e, CallStart) for e in evs))
    assert text[:start + 1].endswith(DS_SEP)  # the name is out once the separator is
    assert sum(isinstance(e, ArgsDelta) for e in flat) > 5  # the arguments in pieces
    assert "".join(e.text for e in flat if isinstance(e, ContentDelta)) == "Sure."
    assert stream.finish() == []
    # a content delta never carries a fragment of a marker
    for ch_events in seen:
        for e in ch_events:
            if isinstance(e, ContentDelta):
                assert "<" not in e.text


def test_qwen3_coder_values_typed_by_schema():
    text = _qc("get_weather", city="123", days="4", metric="true", ratio="0.5",
               opts='{"a": 1}', tags="['x', 2]", code="007")
    _, [call] = get_tool_parser("qwen3_coder").parse(text, TOOLS)
    assert json.loads(call.arguments) == {"city": "123", "days": 4, "metric": True,
                                          "ratio": 0.5, "opts": {"a": 1},
                                          "tags": ["x", 2], "code": "007"}
    # without a schema: JSON where it is JSON, text otherwise
    _, [call] = get_tool_parser("qwen3_coder").parse(_qc("other", n="5", s="hi there"))
    assert json.loads(call.arguments) == {"n": 5, "s": "hi there"}
    # a value that does not fit its type stays text
    _, [call] = get_tool_parser("qwen3_coder").parse(_qc("get_weather", days="soon"), TOOLS)
    assert json.loads(call.arguments) == {"days": "soon"}
    # multi-line values keep their inner newlines
    _, [call] = get_tool_parser("qwen3_coder").parse(_qc("noop", body="a\n\nb"))
    assert json.loads(call.arguments) == {"body": "a\n\nb"}


def test_glm45_values_typed_by_schema():
    _, [call] = get_tool_parser("glm45").parse(_glm("get_weather", city="42", days="7"),
                                               TOOLS)
    assert json.loads(call.arguments) == {"city": "42", "days": 7}


def test_registry_names_match_the_flag():
    assert set(tool_parser_names()) == set(TOOL_CALL_PARSERS) - {"auto"}
    assert {"hermes", "llama3", "mistral", "pythonic", "qwen3_coder", "deepseekv3",
            "deepseekv31", "kimi_k2", "glm45", "gpt-oss"} <= set(TOOL_PARSERS)
    for alias, name in TOOL_PARSER_ALIASES.items():
        assert get_tool_parser(alias) is TOOL_PARSERS[name]
        assert canonical_tool_parser(alias) == name
    with pytest.raises(KeyError):
        get_tool_parser("bogus")
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    assert p.parse_args(["--tool-call-parser", "qwen3_coder"]).tool_call_parser == "qwen3_coder"
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "bogus"])


@pytest.mark.parametrize("template,name", [
    ("{{'<|tool_calls_section_begin|>'}}", "kimi_k2"),
    ("'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json'",
     "deepseekv3"),
    ("'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>'", "deepseekv31"),
    ("<|start|>assistant<|channel|>commentary to=functions.x<|message|>", "gpt-oss"),
    ("<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>", "glm45"),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ p }}>", "qwen3_coder"),
    ("<tool_call>\n{\"name\": ...}", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3"),
    ("{{ messages }}", None),
])
def test_auto_detects_the_family(template, name):
    assert detect_tool_parser(template) == name


def test_old_names_stay_importable():
    from server.tools.parsers import (
        PARSERS,
        START_MARKERS,
        ParsedCall,
        call_content,
        detect_parser,
        parse_hermes,
        parse_llama3,
        parse_mistral,
        parse_tool_calls,
    )

    assert parse_hermes("x") == parse_llama3("x") == parse_mistral("x") == ("x", [])
    assert {"hermes", "llama3", "mistral"} <= set(PARSERS) <= set(START_MARKERS)
    assert call_content(["a ", " b "]) == "a\nb" and detect_parser(None) is None
    content, calls = parse_tool_calls("qwen25", '<tool_call>{"name": "f", "arguments": {}}'
                                                '</tool_call>')
    assert calls == [ParsedCall("f", "{}")] and content is None


# ---- the chat writer of today (server/openai/tool_format.py) with the new names -----------

def _outputs(pieces: list[str]):
    from server.tokenizer_manager import ReqOutput

    return [ReqOutput(0, p, [k], {"type": "stop", "matched": None, "message": None}
                      if k == len(pieces) - 1 else None, 3, k + 1)
            for k, p in enumerate(pieces)]


def _assemble(chunks) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", {}
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                e = calls.setdefault(tc["index"], ["", ""])
                e[0] += tc.get("function", {}).get("name") or ""
                e[1] += tc.get("function", {}).get("arguments") or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_todays_chat_stream_equals_its_full_body(parser, text, content, calls):
    """``--tool-call-parser`` takes every name now: the chat writer (which parses at the
    end, holding content back from ``START_MARKERS``) streams what its body says."""
    from server.openai.tool_format import chat_format
    from server.tools.plan import ToolPlan

    plan = ToolPlan(tools=TOOLS, choice="auto", parser=parser)
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)] or [""]
    full = chat_format(plan, "c", "m", 1, 3, False).full([_outputs(pieces)])["choices"][0]
    f = chat_format(plan, "c", "m", 1, 3, False)
    got_content, got_calls = _assemble(
        f.start() + [c for o in _outputs(pieces) for c in f.chunks(o)])
    msg = full["message"]
    assert got_content == (msg["content"] or "")
    assert got_calls == [(tc["function"]["name"], tc["function"]["arguments"])
                         for tc in msg.get("tool_calls") or []]


#: pieces of every family's markers and some text, for outputs made at random
FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=f>", "<parameter=a>", "</parameter>",
             "</function>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "\n", " ",
             "x", '{"a": 1}', "{", "}", "[", "]", DS_BEGIN, DS_CALL, DS_SEP, DS_CALL_END, DS_END,
             "function", "```json", "```", K_BEGIN, K_CALL, "functions.f:0", K_ARGS, K_CALL_END,
             K_END, "<|start|>assistant", "<|channel|>", "analysis", "final",
             "commentary to=functions.f", "<|constrain|>json", "<|message|>", "<|end|>",
             "<|call|>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
             '{"name": "f", "arguments": {}}', "f(a=1)", "<|python_start|>", "<"]


def test_stream_equals_parse_on_random_outputs():
    import random

    rng = random.Random(43)
    for _ in range(40):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        for name, parser in TOOL_PARSERS.items():
            c, cs = parser.parse(text, TOOLS)
            want = (c, [(x.name, x.arguments) for x in cs])
            assert _run(name, pieces) == want, (name, text, pieces)
            assert _run(name, list(text)) == want, (name, text)
