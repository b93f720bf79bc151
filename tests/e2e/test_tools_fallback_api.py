"""The tools fallback on the real embedded model (issue 34, kind 8): SmolLM2's chat template
drops ``tools``, so before the fallback a request with tools had the same prompt as one
without and ``tool_choice: "auto"`` could never call; now the tools are in the prompt, and
the start-up log says so once."""

from __future__ import annotations

import pytest
from api_helpers import chat

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_model_sees_the_tools(shared_server):
    plain = chat(shared_server.url, MESSAGES, max_tokens=1)["usage"]["prompt_tokens"]
    for choice in ("auto", "none", "required"):
        with_tools = chat(shared_server.url, MESSAGES, tools=TOOLS, tool_choice=choice,
                          max_tokens=1)["usage"]["prompt_tokens"]
        assert with_tools > plain + 100, choice  # the hermes tools block (~150 tokens)
    log = shared_server.log_path.read_text()
    assert log.count("the chat template ignores tools") == 1
    assert "parsed with --tool-call-parser hermes" in log


def test_a_tool_round_trip_renders(shared_server):
    """An assistant turn's tool_calls and the tool's result reach the prompt (the template
    rendered neither: the call was an empty assistant turn)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    done = turn + [{"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    n = [chat(shared_server.url, m, tools=TOOLS, max_tokens=1)["usage"]["prompt_tokens"]
         for m in (MESSAGES, turn, done)]
    assert n[1] > n[0] + 15 and n[2] > n[1] + 10, n  # the call's JSON; the response block
