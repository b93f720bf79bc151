"""The reasoning parser through the writers (issue 43 part 2): chat's ``reasoning_content``
(stream and non-stream equal), ``include_reasoning``/``stream_reasoning``, a block cut by
``max_tokens``, ``reasoning_tokens``, Responses' reasoning items, Anthropic's thinking
blocks, tool calls parsed from the answer only, special tokens stripped; and the engine's
grammar that waits for the think-end token.

A fake engine: each test feeds ``ReqOutput``s of known text, one token per piece (token ids
are the piece's position; ``END_ID`` is ``</think>``'s)."""

from __future__ import annotations

import asyncio
import types

import pytest

from server.anthropic.events import MessageBuilder
from server.http.errors import APIError
from server.openai.formats import ChatFormat
from server.openai.tool_format import chat_format
from server.parsers.reasoning import get_reasoning_parser
from server.pipeline.reasoning import (
    ReasoningPlan,
    plan_reasoning,
    special_token_texts,
    strip_specials,
)
from server.responses.events import ResponseBuilder
from server.tokenizer_manager import ReqOutput
from server.tools.plan import ToolPlan

END_ID = 1000
PIECES = ["<think>", "Let me", " think", ".", "</think>", "\n\n", "The answer", " is 4."]
TOOL_PIECES = ["<think>", "need a tool", "</think>", "\n\n", "<tool_call>",
               '{"name": "get", ', '"arguments": {"q": 1}}', "</tool_call>"]


def outputs(pieces: list[str], finish: str = "stop") -> list[ReqOutput]:
    """One output per piece, token ids 0.., ``END_ID`` for ``</think>``; the last finishes."""
    outs = []
    for i, p in enumerate(pieces):
        tid = END_ID if p == "</think>" else i
        fin = {"type": finish} if i == len(pieces) - 1 else None
        outs.append(ReqOutput(0, p, [tid], fin, 5, i + 1))
    return outs


def plan(name: str = "qwen3", **kw) -> ReasoningPlan:
    return ReasoningPlan(get_reasoning_parser(name), end_id=END_ID, **kw)


def chat_fmt(reasoning=None, tools: ToolPlan | None = None, strip=()) -> ChatFormat:
    return chat_format(tools or ToolPlan(), "chatcmpl-1", "m", 1, 5, True, False,
                       reasoning=reasoning, strip=strip)


def stream_message(fmt: ChatFormat, outs: list[ReqOutput]) -> tuple[dict, list[dict]]:
    """The message a stream's deltas add up to, and the chunks."""
    chunks = [c for o in outs for c in fmt.chunks(o)]
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    fin = None
    for c in chunks:
        ch = c["choices"][0]
        d = ch["delta"]
        msg["content"] += d.get("content") or ""
        msg["reasoning_content"] += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            call = msg["tool_calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc.get("function", {}).get("name") or ""
            call["arguments"] += tc.get("function", {}).get("arguments") or ""
        fin = ch["finish_reason"] or fin
    msg["finish_reason"] = fin
    return msg, chunks


def test_chat_non_stream_splits_reasoning_and_counts_its_tokens():
    body = chat_fmt(plan()).full([outputs(PIECES)])
    m = body["choices"][0]["message"]
    assert m["reasoning_content"] == "Let me think."
    assert m["content"] == "The answer is 4."
    assert body["choices"][0]["finish_reason"] == "stop"
    # <think>, 3 reasoning pieces, </think>: 5 tokens
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}


def test_chat_stream_equals_non_stream():
    body = chat_fmt(plan()).full([outputs(PIECES)])
    msg, chunks = stream_message(chat_fmt(plan()), outputs(PIECES))
    full = body["choices"][0]["message"]
    assert msg["reasoning_content"] == full["reasoning_content"]
    assert msg["content"] == full["content"]
    assert msg["finish_reason"] == "stop"
    # the reasoning streams piece by piece, before any content
    kinds = [k for c in chunks for k in c["choices"][0]["delta"] if k != "role"]
    assert kinds.index("content") > kinds.index("reasoning_content")
    assert kinds.count("reasoning_content") >= 3


def test_without_parser_the_output_is_content_as_written():
    body = chat_fmt(None).full([outputs(PIECES)])
    m = body["choices"][0]["message"]
    assert m["content"] == "".join(PIECES) and "reasoning_content" not in m
    assert "completion_tokens_details" not in body["usage"]


def test_include_reasoning_false_drops_it_but_counts_it():
    body = chat_fmt(plan(include=False)).full([outputs(PIECES)])
    assert body["choices"][0]["message"]["reasoning_content"] is None
    assert body["choices"][0]["message"]["content"] == "The answer is 4."
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5
    msg, _ = stream_message(chat_fmt(plan(include=False)), outputs(PIECES))
    assert msg["reasoning_content"] == "" and msg["content"] == "The answer is 4."


def test_stream_reasoning_false_sends_it_in_one_piece_at_its_end():
    msg, chunks = stream_message(chat_fmt(plan(stream_reasoning=False)), outputs(PIECES))
    pieces = [c["choices"][0]["delta"]["reasoning_content"] for c in chunks
              if "reasoning_content" in c["choices"][0]["delta"]]
    assert pieces == ["Let me think."]
    assert msg["content"] == "The answer is 4."


def test_a_block_cut_by_max_tokens_is_reasoning_with_finish_length():
    cut = outputs(PIECES[:3], finish="length")
    body = chat_fmt(plan()).full([cut])
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == "Let me think"
    assert choice["message"]["content"] == ""
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    msg, _ = stream_message(chat_fmt(plan()), outputs(PIECES[:3], finish="length"))
    assert msg["reasoning_content"] == "Let me think" and msg["finish_reason"] == "length"


def test_thinking_switched_off_all_content_no_reasoning_tokens():
    off = ReasoningPlan(get_reasoning_parser("qwen3", {"enable_thinking": False}),
                        end_id=END_ID)
    body = chat_fmt(off).full([outputs(["Hello", " there"])])
    assert body["choices"][0]["message"]["content"] == "Hello there"
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


TOOLS = ToolPlan(tools=[{"type": "function", "function": {"name": "get"}}], choice="auto",
                 parser="hermes")


def test_tool_calls_come_from_the_answer_only():
    body = chat_fmt(plan(), TOOLS).full([outputs(TOOL_PIECES)])
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == "need a tool"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get", "arguments": '{"q": 1}'}]
    assert choice["finish_reason"] == "tool_calls"
    msg, _ = stream_message(chat_fmt(plan(), TOOLS), outputs(TOOL_PIECES))
    assert msg["reasoning_content"] == "need a tool"
    assert msg["tool_calls"] == {0: {"name": "get", "arguments": '{"q": 1}'}}
    assert msg["finish_reason"] == "tool_calls"


def test_a_call_inside_the_reasoning_is_no_call():
    pieces = ["<think>", "<tool_call>", '{"name": "get", "arguments": {}}', "</tool_call>",
              "</think>", "done"]
    body = chat_fmt(plan(), TOOLS).full([outputs(pieces)])
    m = body["choices"][0]["message"]
    assert "tool_calls" not in m and m["content"] == "done"


def test_special_tokens_are_stripped_from_what_is_sent():
    pieces = ["<think>", "hm", "</think>", "ok", "<|im_end|>"]
    body = chat_fmt(plan(), strip=("<|im_end|>",)).full([outputs(pieces)])
    assert body["choices"][0]["message"]["content"] == "ok"
    msg, _ = stream_message(chat_fmt(plan(), strip=("<|im_end|>",)), outputs(pieces))
    assert msg["content"] == "ok"
    assert strip_specials("a<s>b</s>", ("</s>", "<s>")) == "ab"
    tok = types.SimpleNamespace(all_special_tokens=["<s>", "</s>", "<|im_end|>"])
    assert special_token_texts(tok) == ("<|im_end|>", "</s>", "<s>")


def _response_items() -> tuple[dict, list[dict]]:
    build = ResponseBuilder("resp_1", "m", chat_fmt(plan()), {})
    events = build.start()
    for o in outputs(PIECES):
        events += build.feed(o)
    return build.response(), events


def test_responses_reasoning_item_then_message():
    resp, events = _response_items()
    rs, msg = resp["output"]
    assert rs["type"] == "reasoning" and rs["summary"] == []
    assert rs["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert rs["status"] == "completed" and rs["id"].startswith("rs_")
    assert msg["type"] == "message"
    assert msg["content"][0]["text"] == "The answer is 4."
    assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": 5}
    types_ = [e["type"] for e in events]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == "Let me think."
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert done[0]["text"] == "Let me think." and done[0]["output_index"] == 0
    assert types_.index("response.reasoning_text.done") < types_.index(
        "response.output_text.delta")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_responses_reasoning_effort_goes_to_the_template():
    from server.responses.request import echo_fields, parse_responses_request, to_chat

    req = parse_responses_request({"model": "m", "input": "hi",
                                   "reasoning": {"effort": "low"}})
    assert to_chat(req).body["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert echo_fields(req)["reasoning"] == {"effort": "low", "summary": None}
    # reasoning.summary is echoed as sent (a documented no-op)
    req = parse_responses_request({"model": "m", "input": "hi",
                                   "reasoning": {"effort": "high", "summary": "auto"}})
    assert echo_fields(req)["reasoning"] == {"effort": "high", "summary": "auto"}
    # OpenAI's values only: another is a 400 naming the field
    for reasoning, param in (({"effort": "extreme"}, "reasoning.effort"),
                             ({"effort": 3}, "reasoning.effort"),
                             ({"summary": "verbose"}, "reasoning.summary")):
        with pytest.raises(APIError) as exc:
            parse_responses_request({"model": "m", "input": "hi", "reasoning": reasoning})
        assert exc.value.status == 400 and exc.value.param == param
    # an earlier turn's reasoning item is accepted (and left out of the prompt)
    req = parse_responses_request({"model": "m", "input": [
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "x"}]},
        {"role": "user", "content": "hi"}]})
    assert to_chat(req).body["messages"] == [{"role": "user", "content": "hi"}]


def test_anthropic_thinking_block_then_text():
    build = MessageBuilder("msg_1", "m", chat_fmt(plan()), [])
    events = []
    for o in outputs(PIECES):
        events += build.feed(o)
    blocks = build.message()["content"]
    assert blocks == [{"type": "thinking", "thinking": "Let me think.", "signature": ""},
                      {"type": "text", "text": "The answer is 4."}]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"thinking_delta", "text_delta"}


class _Chat:
    def __init__(self, arg, template="<|im_start|>{{ '<think>' }}"):
        self.args = types.SimpleNamespace(reasoning_parser=arg)
        self.reasoning_parser = arg
        self.tokenizer = types.SimpleNamespace(
            chat_template=template,
            encode=lambda text, add_special_tokens=False: [END_ID] if text == "</think>"
            else [1, 2])
        self.tail = "<|im_start|>assistant\n"

    async def decode(self, ids, skip_special_tokens=False):
        return self.tail


def _req(**extra):
    return types.SimpleNamespace(chat_template_kwargs=None, model_extra=extra)


def test_plan_reasoning_reads_the_fields_and_the_prompt():
    asyncio.run(_plan_reasoning_cases())


async def _plan_reasoning_cases():
    tm = types.SimpleNamespace(chat=_Chat("qwen3"))
    p, think_end, special = await plan_reasoning(tm, _req(), [1, 2])
    assert p.include and p.stream_reasoning and p.end_id == END_ID
    assert think_end == END_ID and not special
    p, _, _ = await plan_reasoning(tm, _req(include_reasoning=False, stream_reasoning=False),
                                   [1])
    assert not p.include and not p.stream_reasoning
    # separate_reasoning false: no split, the constraint still waits for the reasoning
    p, think_end, _ = await plan_reasoning(tm, _req(separate_reasoning=False), [1])
    assert p is None and think_end == END_ID
    # a prompt that closed the thinking: no reasoning, the constraint applies from the start
    tm.chat.tail = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    p, think_end, _ = await plan_reasoning(tm, _req(), [1])
    assert think_end is None and not p.parser.enabled
    # off, auto, gpt-oss (reads special tokens)
    assert await plan_reasoning(types.SimpleNamespace(chat=_Chat(None)), _req(), [1]) == (
        None, None, False)
    tm = types.SimpleNamespace(chat=_Chat("auto"))
    assert (await plan_reasoning(tm, _req(), [1]))[0].parser.name == "qwen3"
    tm = types.SimpleNamespace(chat=_Chat("gpt-oss"))
    p, think_end, special = await plan_reasoning(tm, _req(), [1])
    assert special and think_end == [1, 2]  # the final channel header's ids


def test_grammar_waits_for_the_think_end_token():
    pytest.importorskip("xgrammar")
    import torch

    from engine.sampling.grammar import GrammarBackend, GrammarState
    from engine.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id])
    compiled = backend.submit("regex", "yes|no").result()
    end = tok.encode(".")[0]
    state = GrammarState(compiled, wait_for=end)
    mask = torch.zeros((1, (len(tok) + 31) // 32), dtype=torch.int32)
    state.fill(mask, 0)
    assert bool((mask == -1).all())  # free while thinking
    free = tok.encode(" anything")[0]
    assert state.accept(free) and not state.terminated and not state.active
    assert state.accept(end) and state.active  # the end token: the grammar applies now
    state.fill(mask, 0)
    assert not bool((mask == -1).all())  # tokens masked off now
    assert not state.accept(free)


def _regex_state():
    from engine.sampling.grammar import GrammarBackend, GrammarState
    from engine.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id])
    return tok, GrammarState(backend.submit("regex", "yes|no").result())


def test_grammar_waits_for_a_token_sequence():
    """A sequence trigger releases the grammar exactly after its last token; a partial
    match followed by another token starts over (and a restart inside counts)."""
    pytest.importorskip("xgrammar")
    tok, state = _regex_state()
    a, b, c, x = (tok.encode(t)[0] for t in (" alpha", " beta", " gamma", " anything"))
    state.wait_after([a, b, c])
    for t in (a, b, x, c, a, a, b):  # partial matches, broken; then a restart
        assert state.accept(t) and not state.active and not state.terminated
    assert state.accept(c) and state.active  # a, b, c in a row: released here
    assert not state.accept(x) and state.failed  # the grammar applies from now


def test_sequence_trigger_counts_the_prompt_end():
    pytest.importorskip("xgrammar")
    tok, state = _regex_state()
    a, b, x = (tok.encode(t)[0] for t in (" alpha", " beta", " anything"))
    state.wait_after([a, b], history=[x, x, a])  # the prompt ends with the trigger's start
    assert not state.active
    assert state.accept(b) and state.active
    tok, state = _regex_state()
    state.wait_after([a, b], history=[x, a, b])  # the prompt ends with the whole trigger
    assert state.active
    tok, state = _regex_state()
    state.wait_after([a, b], history=[a])
    assert state.accept(x) and state.accept(b) and not state.active  # x broke it
    with pytest.raises(ValueError):
        state.wait_after([])


def test_think_end_ids_bounds():
    from engine.sampling.params import MAX_TRIGGER_TOKENS, SamplingParams

    SamplingParams(think_end_ids=[1, 2]).verify(10)
    for sp in (SamplingParams(think_end_ids=[]), SamplingParams(think_end_ids=[1, 10]),
               SamplingParams(think_end_ids=[1], think_end_id=1),
               SamplingParams(think_end_ids=[1] * (MAX_TRIGGER_TOKENS + 1))):
        with pytest.raises(ValueError) as e:
            sp.verify(10)
        assert e.value.args[1] == "think_end_ids"


def test_grammar_queue_sets_the_trigger_of_the_request():
    """The scheduler's grammar queue gives a released request's matcher its trigger:
    ``think_end_ids`` (the prompt's last tokens counting toward it) or ``think_end_id``."""
    pytest.importorskip("xgrammar")
    from engine.sampling.params import SamplingParams
    from engine.scheduler.grammar_queue import GrammarQueue
    from engine.scheduler.request import Req
    from engine.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    a, b, x = (tok.encode(t)[0] for t in (" alpha", " beta", " anything"))
    q = GrammarQueue(tok, len(tok), [tok.eos_token_id])
    seq = Req("seq", [x, a], SamplingParams(regex="yes|no", think_end_ids=[a, b]))
    one = Req("one", [x, a], SamplingParams(regex="yes|no", think_end_id=b))
    both = Req("both", [x], SamplingParams(regex="yes|no"))
    for r in (seq, one, both):
        assert q.add(r)
    ready = []
    for _ in range(100):
        got, rejected = q.release(idle=True)
        ready += got
        assert not rejected
        if not len(q):
            break
    assert {r.rid for r in ready} == {"seq", "one", "both"}
    assert both.grammar.active and not seq.grammar.active and not one.grammar.active
    assert seq.grammar.accept(b) and seq.grammar.active  # the prompt's a, then b
    assert one.grammar.accept(x) and not one.grammar.active
    assert one.grammar.accept(b) and one.grammar.active
