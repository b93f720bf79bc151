"""gpt-oss's harmony through the chat pipeline's pieces, without a model: the prompt
(``chat_prompt`` with the harmony template of ``tests/engine/harmony_helpers.py``: system
and developer messages, ``reasoning_effort``, tools as ``namespace functions``, the
assistant's reasoning and call and the tool's result rendered back), the parsers the
architecture chooses (``ChatTokenizer``'s family defaults), the turn-end tokens the engine
stops on, and harmony token sequences through the chat writer (reasoning separated, a
commentary call turned into ``tool_calls`` with JSON arguments; every split of the stream
giving the non-stream answer)."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path

import pytest

from server.chat_template import ChatTokenizer
from server.openai.protocol import ChatCompletionRequest
from server.parsers.reasoning import get_reasoning_parser
from server.pipeline.prompt import chat_prompt
from server.pipeline.reasoning import ReasoningPlan
from server.tokenizer_manager import ReqOutput
from server.tools.plan import ToolPlan, plan_tools

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "engine"))
from harmony_helpers import SPECIALS, harmony_tokenizer  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["c", "f"]}}}}}]
CALL = ["<|channel|>", "analysis", "<|message|>", "Need", " the weather", ".", "<|end|>",
        "<|start|>", "assistant", "<|channel|>", "commentary", " to=functions.get_weather",
        " ", "<|constrain|>", "json", "<|message|>", '{"city"', ': "Paris"}']
FINAL = ["<|channel|>", "analysis", "<|message|>", "Easy", ".", "<|end|>", "<|start|>",
         "assistant", "<|channel|>", "final", "<|message|>", "It is", " 4", "."]
STRIP = tuple(sorted(SPECIALS, key=len, reverse=True))


def _chat(arch="GptOssForCausalLM", reasoning=None, tools="auto") -> ChatTokenizer:
    chat = ChatTokenizer(types.SimpleNamespace(tool_call_parser=tools,
                                               reasoning_parser=reasoning))
    chat.set_tokenizer(harmony_tokenizer(), arch)
    return chat


def _prompt(messages, **fields) -> str:
    chat = _chat()
    req = ChatCompletionRequest(model="m", messages=messages, **fields)
    plan = plan_tools(req, chat.tokenizer.chat_template, chat.tool_call_parser)
    tm = types.SimpleNamespace(chat=chat, images=None, image_pad=lambda: None)  # text only
    ids = asyncio.run(chat_prompt(tm, req, plan))
    return chat.tokenizer.decode(ids)


def test_architecture_picks_the_harmony_parsers_unless_flags_say_otherwise(caplog):
    with caplog.at_level("INFO", logger="ferry.server"):
        chat = _chat()
    assert (chat.reasoning_parser, chat.tool_call_parser) == ("gpt-oss", "gpt-oss")
    assert "defaulting to --reasoning-parser gpt-oss and --tool-call-parser gpt-oss" \
        in caplog.text
    chat = _chat(reasoning="qwen3", tools="hermes")
    assert (chat.reasoning_parser, chat.tool_call_parser) == ("qwen3", "hermes")
    chat = _chat(arch="LlamaForCausalLM")
    assert (chat.reasoning_parser, chat.tool_call_parser) == (None, "auto")


def test_prompt_renders_system_developer_effort_and_tools():
    text = _prompt([{"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Paris?"}],
                   tools=TOOLS, reasoning_effort="high",
                   chat_template_kwargs={"current_date": "2026-12-03"})
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Current date: 2026-12-03\n\nReasoning: high\n\n" in text
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in text
    assert ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n"
            "## functions\n\nnamespace functions {\n\n// Weather of a city.\n"
            "type get_weather = (_: {\n// the city\ncity: string,\nunit?: \"c\" | \"f\",\n"
            "}) => any;\n\n} // namespace functions<|end|>") in text
    assert text.endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    assert "Reasoning: medium" in _prompt([{"role": "user", "content": "hi"}])


def test_prompt_renders_the_call_and_its_result_back():
    text = _prompt([{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "reasoning_content": "Need it.",
                     "tool_calls": [{"id": "c1", "type": "function", "function": {
                         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "20 C"}], tools=TOOLS)
    assert text.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need it.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"20 C"'
        "<|end|><|start|>assistant")
    with pytest.raises(Exception, match="reasoning_effort must be a string"):
        _prompt([{"role": "user", "content": "hi"}], reasoning_effort=3)


def test_harmony_turn_end_tokens_stop_the_engine():
    from engine.tokenizer.tokenizer import eos_token_ids

    tok = harmony_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    oss = types.SimpleNamespace(architectures=["GptOssForCausalLM"], eos_token_id=ids["<|return|>"])
    assert eos_token_ids(oss, tok) == sorted([ids["<|return|>"], ids["<|call|>"]])
    other = types.SimpleNamespace(architectures=["LlamaForCausalLM"], eos_token_id=5)
    assert eos_token_ids(other, tok) == sorted({5, ids["<|return|>"]})


def _outputs(pieces, finish="stop"):
    return [ReqOutput(0, p, [i], {"type": finish} if i == len(pieces) - 1 else None, 5, i + 1)
            for i, p in enumerate(pieces)]


def _format(tools: bool):
    from server.openai.tool_format import chat_format

    plan = ToolPlan(tools=TOOLS, choice="auto", parser="gpt-oss") if tools else ToolPlan()
    return chat_format(plan, "chatcmpl-1", "m", 1, 5, True, False,
                       reasoning=ReasoningPlan(get_reasoning_parser("gpt-oss")), strip=STRIP)


def _streamed(pieces, tools: bool) -> dict:
    fmt = _format(tools)
    msg = {"reasoning_content": "", "content": "", "calls": {}, "finish": None}
    for out in _outputs(pieces):
        for c in fmt.chunks(out):
            ch = c["choices"][0]
            d = ch["delta"]
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            msg["content"] += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                call = msg["calls"].setdefault(tc["index"], ["", ""])
                call[0] += tc.get("function", {}).get("name") or ""
                call[1] += tc.get("function", {}).get("arguments") or ""
            msg["finish"] = ch["finish_reason"] or msg["finish"]
    return msg


def _splits(pieces):
    """The text cut after each character, and token by token."""
    text = "".join(pieces)
    yield pieces
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def test_commentary_call_becomes_tool_calls_stream_and_not():
    body = _format(True).full([_outputs(CALL)])
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == "Need the weather."
    assert choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert choice["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 4
    for pieces in _splits(CALL):
        msg = _streamed(pieces, True)
        assert msg == {"reasoning_content": "Need the weather.", "content": "",
                       "calls": {0: ["get_weather", '{"city": "Paris"}']},
                       "finish": "tool_calls"}, pieces


def test_final_channel_is_content_stream_and_not():
    body = _format(False).full([_outputs(FINAL)])
    m = body["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == ("Easy.", "It is 4.")
    assert body["choices"][0]["finish_reason"] == "stop"
    for pieces in _splits(FINAL):
        msg = _streamed(pieces, False)
        assert (msg["reasoning_content"], msg["content"], msg["finish"]) == (
            "Easy.", "It is 4.", "stop"), pieces


def _job_format(**fields):
    """The chat writer a request's own plans give (``prepare``'s tools and reasoning
    settings), and the job's sampling params."""
    from server.openai.tool_format import chat_format
    from server.pipeline.job import _reasoning_settings
    from server.tools.plan import prepare_chat

    chat = _chat()
    tm = types.SimpleNamespace(chat=chat, images=None, image_pad=lambda: None)  # text only
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    req = ChatCompletionRequest(model="m", **fields)
    sp = req.sampling_params(32)
    tools, sp = asyncio.run(prepare_chat(req, sp, chat.tokenizer.chat_template,
                                         chat.tool_call_parser))
    ids = asyncio.run(chat_prompt(tm, req, tools))
    reasoning, sp, strip = asyncio.run(_reasoning_settings(tm, req, ids, tools, sp))
    fmt = chat_format(tools, "chatcmpl-1", "m", 1, 5, True, False, reasoning=reasoning,
                      strip=strip)
    return fmt, sp


@pytest.mark.parametrize("fields", [{}, {"tools": TOOLS, "tool_choice": "none"}])
def test_a_call_without_tools_is_its_body_as_content_no_markup(fields):
    fmt, _ = _job_format(**fields)
    m = fmt.full([_outputs(CALL)])["choices"][0]
    assert (m["message"]["reasoning_content"], m["message"]["content"]) == (
        "Need the weather.", '{"city": "Paris"}')
    assert m["message"].get("tool_calls") is None and m["finish_reason"] == "stop"
    for pieces in _splits(CALL):
        fmt, _ = _job_format(**fields)
        msg = {"r": "", "c": "", "calls": False, "finish": None}
        for out in _outputs(pieces):
            for c in fmt.chunks(out):
                ch = c["choices"][0]
                msg["r"] += ch["delta"].get("reasoning_content") or ""
                msg["c"] += ch["delta"].get("content") or ""
                msg["calls"] |= bool(ch["delta"].get("tool_calls"))
                msg["finish"] = ch["finish_reason"] or msg["finish"]
        assert msg == {"r": "Need the weather.", "c": '{"city": "Paris"}', "calls": False,
                       "finish": "stop"}, pieces


def test_with_tools_the_call_still_parses():
    fmt, _ = _job_format(tools=TOOLS)
    m = fmt.full([_outputs(CALL)])["choices"][0]
    assert m["message"]["content"] is None and m["finish_reason"] == "tool_calls"
    assert m["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_call_to_an_unknown_function_is_content_without_markup():
    unknown = [p.replace("get_weather", "nope") for p in CALL]
    for pieces in _splits(unknown):
        fmt, _ = _job_format(tools=TOOLS)
        msg = {"c": "", "calls": False, "finish": None}
        for out in _outputs(pieces):
            for c in fmt.chunks(out):
                ch = c["choices"][0]
                msg["c"] += ch["delta"].get("content") or ""
                msg["calls"] |= bool(ch["delta"].get("tool_calls"))
                msg["finish"] = ch["finish_reason"] or msg["finish"]
        assert msg == {"c": '{"city": "Paris"}', "calls": False, "finish": "stop"}, pieces
    fmt, _ = _job_format(tools=TOOLS)
    m = fmt.full([_outputs(unknown)])["choices"][0]
    assert (m["message"]["content"], m["finish_reason"]) == ('{"city": "Paris"}', "stop")


def test_a_stop_string_inside_the_arguments_is_no_call_stop_finish():
    cut = CALL[:-2] + ["{"]   # stop=['"city"'] matched right after the ``{``
    outs = _outputs(cut)
    outs[-1] = ReqOutput(0, cut[-1], [len(cut) - 1], {"type": "stop", "matched": '"city"'}, 5,
                         len(cut))
    fmt, _ = _job_format(tools=TOOLS)
    m = fmt.full([outs])["choices"][0]
    assert m["message"].get("tool_calls") is None
    assert (m["message"]["content"], m["finish_reason"], m["matched_stop"]) == (
        "{", "stop", '"city"')
    fmt, _ = _job_format(tools=TOOLS)
    msg = {"c": "", "calls": False, "finish": None}
    for out in outs:
        for c in fmt.chunks(out):
            ch = c["choices"][0]
            msg["c"] += ch["delta"].get("content") or ""
            msg["calls"] |= bool(ch["delta"].get("tool_calls"))
            msg["finish"] = ch["finish_reason"] or msg["finish"]
    assert msg == {"c": "{", "calls": False, "finish": "stop"}
    from server.anthropic.events import MessageBuilder

    fmt, _ = _job_format(tools=TOOLS)
    build = MessageBuilder("msg_1", "m", fmt, ['"city"'])
    for out in outs:
        build.feed(out)
    body = build.message()
    assert [b["type"] for b in body["content"]] == ["thinking", "text"]
    assert (body["content"][1]["text"], body["stop_reason"], body["stop_sequence"]) == (
        "{", "stop_sequence", '"city"')


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}},
    {"guided_regex": "a+"}])
def test_an_output_constraint_waits_for_the_final_channel_header(fields):
    """``response_format`` and the guided fields constrain harmony's answer: the engine's
    matcher waits for the final channel header's token ids in a row."""
    from server.pipeline.reasoning import HARMONY_FINAL_HEADER

    _, sp = _job_format(**fields)
    head = harmony_tokenizer().encode(HARMONY_FINAL_HEADER, add_special_tokens=False)
    assert sp.think_end_ids == head and len(head) > 1 and sp.think_end_id is None
    assert sp.json_schema or sp.regex
    _, sp = _job_format()  # no constraint: no trigger
    assert sp.think_end_ids is None and sp.think_end_id is None


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_tool_call_with_harmony_is_a_grammar_read_by_the_gpt_oss_parser(choice):
    """A forced call with harmony: the whole output is constrained (an EBNF from the first
    token: no release trigger), and the writer reads the commentary call as with
    ``auto``, stream and not."""
    fmt, sp = _job_format(tools=TOOLS, tool_choice=choice)
    assert sp.ebnf is not None and sp.json_schema is None
    assert sp.think_end_ids is None and sp.think_end_id is None
    assert not sp.skip_special_tokens
    choice_ = fmt.full([_outputs(CALL)])["choices"][0]
    assert choice_["message"]["reasoning_content"] == "Need the weather."
    assert [c["function"] for c in choice_["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert choice_["finish_reason"] == "tool_calls"
    for pieces in _splits(CALL):
        fmt, _ = _job_format(tools=TOOLS, tool_choice=choice)
        assert _stream_message(fmt, pieces) == {
            "r": "Need the weather.", "c": "",
            "calls": {0: ["get_weather", '{"city": "Paris"}']}, "finish": "tool_calls"}, pieces


def test_a_forced_tool_call_with_harmony_is_a_400_where_it_cannot_work():
    """400s naming ``tool_choice``: a prompt that does not end with the assistant's header
    (no generation prompt), a tokenizer without harmony's markers as single tokens, a forced
    call beside another output constraint (as for every model)."""
    from server.http.errors import APIError
    from server.tools.harmony_calls import marker_ids

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    for fields in ({"add_generation_prompt": False, "messages": msgs},
                   {"response_format": {"type": "json_object"}}):
        with pytest.raises(APIError) as err:
            _job_format(tools=TOOLS, tool_choice=NAMED, **fields)
        assert (err.value.status, err.value.param) == (400, "tool_choice"), fields
    assert marker_ids(types.SimpleNamespace(encode=lambda t, add_special_tokens: [1, 2])) \
        is None
    assert set(marker_ids(harmony_tokenizer())) >= {"<|start|>", "<|constrain|>", "<|call|>"}


PICK = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "warm": {"type": "boolean"}},
        "required": ["city", "warm"], "additionalProperties": False}
FLIP = {"type": "object", "properties": {"side": {"enum": ["heads", "tails"]}},
        "required": ["side"]}
TWO = [{"type": "function", "function": {"name": n, "parameters": p}}
       for n, p in (("pick", PICK), ("flip", FLIP))]


def _random_walk(sp, tok, seed: int, limit: int = 400) -> list[int]:
    """What a random model writes under ``sp``'s grammar (the engine's ``GrammarState``):
    each token drawn uniformly from those the grammar allows, up to a turn-end token."""
    import random

    import torch

    from engine.sampling.grammar import GrammarBackend, GrammarState, grammar_key

    ends = [tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    state = GrammarState(GrammarBackend(tok, len(tok), ends).submit(*grammar_key(sp)).result())
    rng, out = random.Random(seed), []
    while len(out) < limit and not state.terminated:
        mask = torch.empty((1, (len(tok) + 31) // 32), dtype=torch.int32)
        state.fill(mask, 0)
        allowed = [i for i in range(len(tok)) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
        out.append(rng.choice(allowed))
        assert state.accept(out[-1])
    return out


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "pick"}},
                                    "required"])
def test_a_random_model_under_the_grammar_writes_a_valid_call(choice):
    """Tokens drawn at random among those the grammar allows (a random model's output)
    always make one call: the named function (any tool for ``required``), its arguments
    valid for its schema (an enum and a boolean, which free text would not hit); the
    reasoning, when the walk writes one, stops within half of ``max_tokens``."""
    tok = harmony_tokenizer()
    names = set()
    for seed in range(6):
        fmt, sp = _job_format(tools=TWO, tool_choice=choice, max_tokens=200)
        ids = _random_walk(sp, tok, seed)
        assert ids[-1] == tok.convert_tokens_to_ids("<|call|>")
        text = tok.decode(ids)
        body = fmt.full([[ReqOutput(0, text, ids, {"type": "stop",
                                                   "matched": ids[-1]}, 5, len(ids))]])
        choice_ = body["choices"][0]
        assert choice_["finish_reason"] == "tool_calls", text
        (call,) = choice_["message"]["tool_calls"]
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        names.add(name)
        if name == "pick":
            assert args["city"] in ("Paris", "Rome") and isinstance(args["warm"], bool)
            assert set(args) == {"city", "warm"}
        else:
            assert name == "flip" and choice == "required" and args["side"] in FLIP[
                "properties"]["side"]["enum"]
        reasoning = choice_["message"].get("reasoning_content") or ""
        assert len(tok.encode(reasoning, add_special_tokens=False)) <= 100
    assert names == ({"pick", "flip"} if choice == "required" else {"pick"})


def _stream_message(fmt, pieces) -> dict:
    msg = {"r": "", "c": "", "calls": {}, "finish": None}
    for out in _outputs(pieces):
        for c in fmt.chunks(out):
            ch = c["choices"][0]
            msg["r"] += ch["delta"].get("reasoning_content") or ""
            msg["c"] += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls") or []:
                call = msg["calls"].setdefault(tc["index"], ["", ""])
                call[0] += tc.get("function", {}).get("name") or ""
                call[1] += tc.get("function", {}).get("arguments") or ""
            msg["finish"] = ch["finish_reason"] or msg["finish"]
    return msg


def test_separate_reasoning_false_with_tools_keeps_the_reasoning_inline():
    """With ``separate_reasoning: false`` the analysis text is content (as without tools,
    where the whole output is), and the commentary call still parses."""
    plain, _ = _job_format(separate_reasoning=False)
    m = plain.full([_outputs(CALL)])["choices"][0]["message"]
    assert "Need the weather." in m["content"] and m.get("reasoning_content") is None
    fmt, _ = _job_format(tools=TOOLS, separate_reasoning=False)
    choice = fmt.full([_outputs(CALL)])["choices"][0]
    m = choice["message"]
    assert m.get("reasoning_content") is None and m["content"] == "Need the weather."
    assert [c["function"] for c in m["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert choice["finish_reason"] == "tool_calls"
    for pieces in _splits(CALL):
        fmt, _ = _job_format(tools=TOOLS, separate_reasoning=False)
        assert _stream_message(fmt, pieces) == {
            "r": "", "c": "Need the weather.",
            "calls": {0: ["get_weather", '{"city": "Paris"}']}, "finish": "tool_calls"}, pieces
    # a call to an unknown function: its body is content, the reasoning still inline
    unknown = [p.replace("get_weather", "nope") for p in CALL]
    fmt, _ = _job_format(tools=TOOLS, separate_reasoning=False)
    m = fmt.full([_outputs(unknown)])["choices"][0]["message"]
    assert (m["content"], m.get("tool_calls")) == ('Need the weather.{"city": "Paris"}', None)
