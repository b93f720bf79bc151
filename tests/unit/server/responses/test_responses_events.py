"""The event order of a streamed ``/v1/responses`` answer with parallel function calls.

Reference: OpenAI's stream finishes one output item before the next starts (each item's
``output_item.added`` ... ``output_item.done`` contiguous, ``output_index`` increasing), and
its final ``response`` equals the non-stream body (hand-written orders below)."""

from __future__ import annotations

from server.openai.tool_format import chat_format
from server.responses.events import ResponseBuilder
from server.tokenizer_manager import ReqOutput
from server.tools.plan import ToolPlan

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]
CALLS = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>']


def _builder() -> ResponseBuilder:
    plan = ToolPlan(tools=TOOLS, choice="auto", parser="hermes")
    return ResponseBuilder("resp_1", "m", chat_format(plan, "r", "m", 1, 5, False), {})


def _outputs(pieces: list[str]) -> list[ReqOutput]:
    return [ReqOutput(0, p, [i], {"type": "stop"} if i == len(pieces) - 1 else None, 5, i + 1)
            for i, p in enumerate(pieces)]


def _without_ids(resp: dict) -> dict:
    out = [{k: v for k, v in item.items() if k not in ("id", "call_id")}
           for item in resp["output"]]
    return dict(resp, id=None, created_at=None, completed_at=None, output=out)


def _check_item_order(events: list[dict]) -> None:
    """Each item's events contiguous, from ``added`` to ``done``, indices increasing."""
    body = [e for e in events if "output_index" in e]
    runs: list[int] = []
    for e in body:
        if not runs or runs[-1] != e["output_index"]:
            runs.append(e["output_index"])
    assert runs == list(range(len(runs))), [(e["type"], e["output_index"]) for e in body]
    for k in runs:
        kinds = [e["type"] for e in body if e["output_index"] == k]
        assert kinds[0] == "response.output_item.added"
        assert kinds[-1] == "response.output_item.done"


def test_parallel_calls_stream_one_item_after_another():
    pieces = ["Checking.\n", *CALLS]
    stream = _builder()
    events = stream.start()
    for o in _outputs(pieces):
        events += stream.feed(o)
    _check_item_order(events)
    kinds = [(e["type"], e["output_index"]) for e in events if "output_index" in e
             and e["type"].startswith(("response.output_item", "response.function_call"))]
    assert kinds[2:] == [
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call",
                                                    "function_call"]
    assert [i["status"] for i in final["output"]] == ["completed"] * 3
    # the non-stream body, built from one output holding the whole text
    whole = _builder()
    whole.feed(ReqOutput(0, "".join(pieces), list(range(3)), {"type": "stop"}, 5, 3))
    assert _without_ids(whole.response()) == _without_ids(final)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
