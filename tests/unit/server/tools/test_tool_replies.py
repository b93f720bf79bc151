"""Tool messages must answer a tool call made before them (``check_tool_replies``,
``server/tools/messages.py``): OpenAI answers a ``tool`` message with no assistant
``tool_calls`` before it, or whose ``tool_call_id`` names none of their ids, with a 400
``invalid_request_error``. Checked on the function, through a chat body, and on the
Responses path, whose ``function_call_output`` check answers first in its own terms."""

from __future__ import annotations

import pytest

from server.http.errors import APIError
from server.openai.protocol import ChatCompletionRequest, parse_request
from server.pipeline.prompt import messages_for_template
from server.responses.input import chat_messages
from server.tools.messages import check_tool_replies

USER = {"role": "user", "content": "Weather in Paris and Rome?"}


def _call(cid: str | None) -> dict:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    return call if cid is None else dict(call, id=cid)


def _asst(*ids: str | None) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [_call(c) for c in ids]}


def _tool(cid: str | None = None) -> dict:
    m = {"role": "tool", "content": "21 C"}
    return m if cid is None else dict(m, tool_call_id=cid)


def _error(messages: list[dict]) -> APIError:
    with pytest.raises(APIError) as ei:
        messages_for_template(parse_request(ChatCompletionRequest,
                                            {"messages": messages}).messages)
    assert ei.value.status == 400
    return ei.value


@pytest.mark.parametrize("messages", [
    [USER, _asst("c1"), _tool("c1")],
    # several tool messages answer one assistant message, in any order
    [USER, _asst("c1", "c2"), _tool("c2"), _tool("c1"), {"role": "user", "content": "ok"}],
    # a later tool message may answer an earlier assistant's call
    [USER, _asst("c1"), _tool("c1"), _asst("c2"), _tool("c2"), _tool("c1")],
    # a call without id (ids are optional in ferry) answered by a tool message without one
    [USER, _asst(None), _tool()],
    [USER, {"role": "assistant", "content": None,
            "function_call": {"name": "get_weather", "arguments": "{}"}}, _tool()],
])
def test_tool_messages_that_answer_an_earlier_call_pass(messages):
    check_tool_replies(messages_for_template(
        parse_request(ChatCompletionRequest, {"messages": messages}).messages))


@pytest.mark.parametrize("messages, param", [
    # no assistant tool_calls before the tool message at all
    ([USER, _tool("c1")], "messages[1].role"),
    ([_tool("c1"), USER], "messages[0].role"),
    ([USER, {"role": "assistant", "content": "Sure."}, _tool("c1")], "messages[2].role"),
    # the calls come after it
    ([USER, _tool("c1"), _asst("c1")], "messages[1].role"),
    # an id of no earlier call
    ([USER, _asst("c1"), _tool("c2")], "messages[2].tool_call_id"),
    ([USER, _asst("c1", "c2"), _tool("c1"), _tool("c2"), _tool("c3")],
     "messages[4].tool_call_id"),
    ([USER, _asst("c1"), _tool("c1"), _tool("c2"), _asst("c2")], "messages[3].tool_call_id"),
    ([USER, _asst(None), _tool("c1")], "messages[2].tool_call_id"),
    ([USER, _asst("c1"), _tool("C1")], "messages[2].tool_call_id"),  # ids are exact
    # a tool_call_id that is not a string was silently dropped before
    ([USER, _asst("c1"), dict(_tool(), tool_call_id=1)], "messages[2].tool_call_id"),
    # missing or null where every call has an id (OpenAI: the parameter is required)
    ([USER, _asst("c1"), _tool()], "messages[2].tool_call_id"),
    ([USER, _asst("c1"), dict(_tool(), tool_call_id=None)], "messages[2].tool_call_id"),
    # one id on two calls of one message
    ([USER, _asst("c1", "c1"), _tool("c1")], "messages[1].tool_calls[1].id"),
])
def test_tool_messages_answering_no_earlier_call_are_400s(messages, param):
    err = _error(messages)
    assert err.param == param, err.message
    sent = messages[int(param.split("[")[1].split("]")[0])].get("tool_call_id")
    if param.endswith("tool_call_id") and isinstance(sent, str):
        assert repr(sent) in err.message  # the message names the id at fault


def test_function_on_template_messages():
    """The function itself, on hand-written template messages (converted calls)."""
    check_tool_replies([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x"}])
    with pytest.raises(APIError) as ei:
        check_tool_replies([{"role": "system", "content": "s"},
                            {"role": "tool", "tool_call_id": "a", "content": "x"}])
    assert ei.value.param == "messages[1].role"


def test_responses_output_before_its_call_names_call_id():
    """Responses' own check names ``input[i].call_id`` (not chat's ``tool_call_id``): an
    output must follow its ``function_call``, as the tool messages follow their calls."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "c1", "output": "x"}
    with pytest.raises(APIError) as ei:
        chat_messages(None, [{"role": "user", "content": "go"}, out, call])
    assert ei.value.param == "input[1].call_id" and "'c1'" in ei.value.message
    msgs, _ = chat_messages(None, [{"role": "user", "content": "go"}, call, out])
    assert msgs[-1] == {"role": "tool", "tool_call_id": "c1", "content": "x"}
    with pytest.raises(APIError) as ei:   # a call_id on two function_calls
        chat_messages(None, [{"role": "user", "content": "go"}, call, call, out])
    assert ei.value.param == "input[2].call_id" and "duplicate" in ei.value.message
    check_tool_replies(messages_for_template(
        parse_request(ChatCompletionRequest, {"messages": msgs}).messages))
