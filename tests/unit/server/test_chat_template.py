"""The tools fallback (server/chat_template.py): a chat template that ignores ``tools`` (the
embedded SmolLM2's) gets them written into the system message in the hermes format, and
``--tool-call-parser auto`` then reads hermes calls (issue 34, kind 8)."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from app_helpers import make_app

from server.chat_template import (
    TOOLS_FOOTER,
    TOOLS_HEADER,
    template_ignores_tools,
    tools_block,
    with_tools_rendered,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

#: a template that shows tools, the way Qwen's does (by name, in the system turn)
SHOWS_TOOLS = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}"
               "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>"
               "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok(embedded_tokenizer):
    return embedded_tokenizer  # the embedded SmolLM2 GGUF's HF tokenizer (tests/conftest.py)


def test_the_embedded_template_ignores_tools_and_others_do_not(tok):
    assert template_ignores_tools(tok)
    shows = copy.copy(tok)
    shows.chat_template = SHOWS_TOOLS
    assert not template_ignores_tools(shows)
    raises = copy.copy(tok)
    raises.chat_template = "{% if tools %}{{ raise_exception('no tools') }}{% endif %}x"
    assert template_ignores_tools(raises)  # it cannot take tools: the fallback shows them
    none = copy.copy(tok)
    none.chat_template = None
    assert not template_ignores_tools(none) and not template_ignores_tools(None)


def test_the_tools_block_is_qwens_hermes_layout():
    block = tools_block(TOOLS)
    assert block.startswith(TOOLS_HEADER) and block.endswith(TOOLS_FOOTER)
    inner = block[len(TOOLS_HEADER):-len(TOOLS_FOOTER)]
    assert [json.loads(line) for line in inner.strip().splitlines()] == TOOLS
    assert "<tool_call>" in block and '"arguments"' in block


def test_messages_with_the_tool_protocol_written_in():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function", "function": {
                 "name": "get_weather", "arguments": {"city": "Paris"}}},
                 {"id": "c2", "type": "function", "function": {
                     "name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
            {"role": "tool", "tool_call_id": "c2", "content": '{"temp_c": 25}'},
            {"role": "user", "content": "Thanks"}]
    before = copy.deepcopy(msgs)
    out = with_tools_rendered(msgs, TOOLS)
    assert msgs == before  # not changed in place
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert out[0]["content"] == "Be brief.\n\n" + tools_block(TOOLS)
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                      '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                      '{"city": "Rome"}}\n</tool_call>'}
    assert out[3]["content"] == ('<tool_response>\n{"temp_c": 21}\n</tool_response>\n'
                                 '<tool_response>\n{"temp_c": 25}\n</tool_response>')
    # no system message: the block is one, first; no tools: no block, calls still rendered
    first = with_tools_rendered([{"role": "user", "content": "Hi"}], TOOLS)
    assert first == [{"role": "system", "content": tools_block(TOOLS)},
                     {"role": "user", "content": "Hi"}]
    assert with_tools_rendered(msgs[1:3], None)[1]["content"].startswith("<tool_call>")
    text = with_tools_rendered([{"role": "assistant", "content": "Let me check.",
                                 "tool_calls": msgs[2]["tool_calls"][:1]}], None)
    assert text[0]["content"].startswith("Let me check.\n<tool_call>\n")


def _app_with(tok, template=None, **kw):
    app, engine = make_app(**kw)
    tm = engine.tm
    t = copy.copy(tok)
    if template is not None:
        t.chat_template = template
    tm.set_tokenizer(t)
    return app, engine, tm


async def _chat(app, **body):
    body.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_template_that_ignores_tools_gets_them_in_the_prompt(tok):
    app, engine, tm = _app_with(tok)
    assert tm.chat.tools_fallback and tm.chat.tool_call_parser == "hermes"
    engine.text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                   '</tool_call>')
    r = await _chat(app, tools=TOOLS, max_tokens=40)
    prompt = tok.decode(engine.sent[-1].input_ids)
    assert tools_block(TOOLS) in prompt and "get_weather" in prompt
    calls = r["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    # without tools the prompt is the template's own
    await _chat(app, max_tokens=4)
    assert "<tools>" not in tok.decode(engine.sent[-1].input_ids)


async def test_a_template_that_shows_tools_is_left_alone(tok):
    app, engine, tm = _app_with(tok, SHOWS_TOOLS)
    assert not tm.chat.tools_fallback and tm.chat.tool_call_parser == "auto"
    await _chat(app, tools=TOOLS, max_tokens=4)
    prompt = tok.decode(engine.sent[-1].input_ids)
    assert "<tools>" not in prompt and "get_weather" in prompt


async def test_an_explicit_parser_is_kept_under_the_fallback(tok):
    _, _, tm = _app_with(tok, tool_call_parser="llama3")
    assert tm.chat.tools_fallback and tm.chat.tool_call_parser == "llama3"


async def test_the_chat_template_flag_replaces_the_tokenizers(tok, tmp_path):
    """``--chat-template FILE`` renders the prompt (/v1/tokenize shows it)."""
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
    app, engine, tm = _app_with(tok, chat_template=str(f))
    assert tm.chat.tokenizer.chat_template == f.read_text()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        r = await c.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    assert tok.decode(r.json()["tokens"]) == "[user] Hi\n[assistant]"
