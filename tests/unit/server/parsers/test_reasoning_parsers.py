"""The ``--reasoning-parser`` families (server/parsers/reasoning.py): each against its
family's documented output (with and without the start tag, switched off, cut by
max_tokens), and their streams: split anywhere, a stream sums to the non-stream parse and
no tag fragment reaches either side."""

from __future__ import annotations

import argparse

import pytest

from engine.args import REASONING_PARSERS, ServerArgs
from server.parsers.reasoning import (
    REASONING_PARSER_ALIASES,
    count_reasoning_tokens,
    detect_reasoning_parser,
    get_reasoning_parser,
    reasoning_parser_names,
    resolve_reasoning_parser,
)

OSS_TOOL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather "
            "<|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>")

# (parser, chat_template_kwargs, text, reasoning, content)
CASES = [
    ("deepseek-r1", None, "Let me think.\n</think>\n\nThe answer is 42.", "Let me think.",
     "The answer is 42."),
    ("deepseek-r1", None, "<think>\nLet me think.</think>42", "Let me think.", "42"),
    ("deepseek-r1", None, "Still thinking when max_tokens hit", "Still thinking when "
     "max_tokens hit", None),
    ("deepseek-r1", None, "</think>Only an answer.", None, "Only an answer."),
    ("deepseek_r1", None, "a < b, so</think>b", "a < b, so", "b"),
    ("deepseek-v3", {"thinking": True}, "Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek-v3", None, "Yes, no thinking.", None, "Yes, no thinking."),
    ("qwen3", None, "<think>\nThe user asks.\n</think>\n\nHello!", "The user asks.",
     "Hello!"),
    ("qwen3", None, "Hello, no tags.", None, "Hello, no tags."),
    ("qwen3", None, "<think>\ncut by max_tokens", "cut by max_tokens", None),
    ("qwen3", None, "<think>\n\n</think>\n\nHello!", None, "Hello!"),
    ("qwen3", {"enable_thinking": False}, "<think>x</think>y", None, "<think>x</think>y"),
    ("qwen3", None, "Use <b>bold</b>.", None, "Use <b>bold</b>."),
    ("qwen3-thinking", None, "Reasoning.\n</think>\n\nAnswer.", "Reasoning.", "Answer."),
    ("glm45", None, "<think>Plan.</think>Done.", "Plan.", "Done."),
    ("glm45", {"enable_thinking": False}, "Done.", None, "Done."),
    ("kimi", None, "◁think▷Let me see.◁/think▷It is 4.", "Let me see.", "It is 4."),
    ("kimi", None, "It is 4.", None, "It is 4."),
    ("kimi_k2", None, "<think>k</think>v", "k", "v"),
    ("gpt-oss", None, "<|channel|>analysis<|message|>User wants X.<|end|><|start|>assistant"
     "<|channel|>final<|message|>Here is X.<|return|>", "User wants X.", "Here is X."),
    ("gpt-oss", None, "<|channel|>analysis<|message|>Need weather.<|end|>" + OSS_TOOL,
     "Need weather.", OSS_TOOL),
    ("gpt-oss", None, "<|channel|>analysis<|message|>cut by max_tok", "cut by max_tok", None),
    ("openai_gptoss", None, "<|channel|>final<|message|>Hi<|return|>", None, "Hi"),
]

TAGS = ("<think>", "</think>", "◁think▷", "◁/think▷", "<|channel|>", "<|message|>",
        "<|end|>", "<|start|>", "<|return|>")


@pytest.mark.parametrize("parser,kwargs,text,reasoning,content", CASES)
def test_parse_documented_output(parser, kwargs, text, reasoning, content):
    assert get_reasoning_parser(parser, kwargs).parse(text) == (reasoning, content)


def _run(parser, kwargs, pieces, want):
    """Feed ``pieces``; after each, what was sent is a prefix of ``want`` (so a tag, or a
    piece of one, is never sent and taken back)."""
    stream = get_reasoning_parser(parser, kwargs).stream()
    r = c = ""
    for p in pieces:
        dr, dc = stream.feed(p)
        r, c = r + dr, c + dc
        assert (want[0] or "").startswith(r) and (want[1] or "").startswith(c), (r, c)
    dr, dc = stream.finish()
    r, c = r + dr, c + dc
    assert stream.result() == (r or None, c or None)
    return r or None, c or None


@pytest.mark.parametrize("parser,kwargs,text,reasoning,content", CASES)
def test_stream_split_anywhere_equals_parse(parser, kwargs, text, reasoning, content):
    want = get_reasoning_parser(parser, kwargs).parse(text)
    for k in range(len(text) + 1):
        assert _run(parser, kwargs, [text[:k], text[k:]], want) == want, k
    assert _run(parser, kwargs, list(text), want) == want
    assert not any(tag in (want[0] or "") for tag in TAGS)


def test_tags_split_across_deltas_never_leak():
    stream = get_reasoning_parser("qwen3").stream()
    out = [stream.feed(d) for d in ("<th", "ink>", "\nAb", "c</th", "ink", ">\n\nAns", "wer")]
    assert out == [("", ""), ("", ""), ("Ab", ""), ("c", ""), ("", ""), ("", "Ans"),
                   ("", "wer")]
    assert stream.finish() == ("", "")


def test_reasoning_tokens_count_the_tokens_inside_the_block():
    stream = get_reasoning_parser("qwen3").stream()
    for tok in ("<think>", "\n", "Let", " me", " see", "</think>", "\n\n", "Hi", "!"):
        stream.feed(tok)
    stream.finish()
    assert stream.reasoning_tokens == 6 and stream.result() == ("Let me see", "Hi!")
    r1 = get_reasoning_parser("deepseek-r1").stream()
    for tok in ("Ok", "</think>", "Yes"):
        r1.feed(tok)
    assert r1.reasoning_tokens == 2
    none = get_reasoning_parser("qwen3", {"enable_thinking": False}).stream()
    for tok in ("Hi", " there"):
        none.feed(tok)
    assert none.reasoning_tokens == 0
    oss = get_reasoning_parser("gpt-oss").stream()
    for tok in ("<|channel|>", "analysis", "<|message|>", "Think", "<|end|>", "<|start|>",
                "assistant", "<|channel|>", "final", "<|message|>", "Done"):
        oss.feed(tok)
    assert oss.reasoning_tokens == 3  # <|message|>, Think, <|end|>
    assert count_reasoning_tokens(get_reasoning_parser("deepseek-r1"),
                                  ["Ok", "</think>", "Yes"]) == 2
    big = get_reasoning_parser("qwen3").stream()
    big.feed("<think>a b c", tokens=4)
    assert big.reasoning_tokens == 4


def test_the_rendered_prompt_decides_where_the_output_starts():
    opened = get_reasoning_parser("qwen3", prompt="<|im_start|>assistant\n<think>\n")
    assert opened.parse("Reasoning.</think>Answer.") == ("Reasoning.", "Answer.")
    off = get_reasoning_parser("qwen3", {"enable_thinking": True},
                               prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.parse("Answer.") == (None, "Answer.")
    v3 = get_reasoning_parser("deepseek-v3", prompt="<｜Assistant｜><think>")
    assert v3.parse("x</think>y") == ("x", "y")


def test_registry_names_match_the_flag():
    assert set(reasoning_parser_names()) == set(REASONING_PARSERS) - {"auto"}
    assert {"deepseek-r1", "deepseek-v3", "qwen3", "glm45", "kimi", "gpt-oss"} <= \
        set(reasoning_parser_names())
    for alias, name in REASONING_PARSER_ALIASES.items():
        assert get_reasoning_parser(alias).name == name
    with pytest.raises(KeyError):
        get_reasoning_parser("bogus")
    assert ServerArgs().reasoning_parser is None
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    assert p.parse_args(["--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"
    assert p.parse_args([]).reasoning_parser is None
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "bogus"])
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        ServerArgs(reasoning_parser="bogus")


@pytest.mark.parametrize("template,name", [
    ("{{'◁think▷'}}", "kimi"),
    ("<|start|>assistant<|channel|>analysis<|message|>", "gpt-oss"),
    ("{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
     "<｜Assistant｜>{% if thinking %}<think>{% else %}</think>{% endif %}", "deepseek-v3"),
    ("<｜Assistant｜><think>\n", "deepseek-r1"),
    ("[gMASK]<sop><|assistant|><think></think>", "glm45"),
    ("<|im_start|>assistant\n{% if enable_thinking is false %}<think>\n\n</think>", "qwen3"),
    ("<|im_assistant|>assistant<|im_middle|><think>", "kimi_k2"),
    ("<|im_start|>assistant\n", None),
    (None, None),
])
def test_auto_detects_the_family(template, name):
    assert detect_reasoning_parser(template) == name
    assert resolve_reasoning_parser("auto", template) == name


def test_resolve_the_flag():
    assert resolve_reasoning_parser(None, "<think>") is None
    assert resolve_reasoning_parser("openai_gptoss", None) == "gpt-oss"
    assert resolve_reasoning_parser("qwen3", None) == "qwen3"
    with pytest.raises(KeyError):
        resolve_reasoning_parser("bogus", None)


def test_gpt_oss_reasoning_then_tool_parser_streamed_as_at_once():
    """The chat pipeline's order: the reasoning parser's content goes to the tool parser."""
    from server.parsers.base import ArgsDelta, CallStart, ContentDelta, ParsedCall
    from server.parsers.tool_registry import get_tool_parser

    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
            "<|channel|>commentary<|message|>Checking.<|end|>" + OSS_TOOL)
    reasoning, content = get_reasoning_parser("gpt-oss").parse(text)
    assert reasoning == "Need the weather."
    tools = get_tool_parser("gpt-oss")
    assert tools.parse(content) == ("Checking.", [ParsedCall("get_weather",
                                                             '{"city":"Paris"}')])
    for size in (1, 3, 11):
        rs, ts = get_reasoning_parser("gpt-oss").stream(), tools.stream()
        r, events = "", []
        for i in range(0, len(text), size):
            dr, dc = rs.feed(text[i:i + size])
            r += dr
            events += ts.feed(dc)
        dr, dc = rs.finish()
        events += ts.feed(dc) + ts.finish()
        assert r + dr == reasoning
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Checking."
        assert [e.name for e in events if isinstance(e, CallStart)] == ["get_weather"]
        assert "".join(e.text for e in events if isinstance(e, ArgsDelta)) == \
            '{"city":"Paris"}'


def test_stream_equals_parse_on_random_outputs():
    import random

    fragments = ["<think>", "</think>", "◁think▷", "◁/think▷", "<|start|>assistant",
                 "<|channel|>", "analysis", "final", "commentary to=functions.f",
                 "<|message|>", "<|end|>", "<|call|>", "<|return|>", "\n", " ", "x", "<"]
    rng = random.Random(43)
    for _ in range(60):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 10)))
        for name in reasoning_parser_names():
            for kwargs in (None, {"enable_thinking": False}, {"thinking": True}):
                want = get_reasoning_parser(name, kwargs).parse(text)
                assert _run(name, kwargs, list(text), want) == want, (name, kwargs, text)
