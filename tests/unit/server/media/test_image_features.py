"""A chat request with an image and the other features through the HTTP app (over the fake
engine of ``app_helpers``, the tiny Qwen2.5-VL tokenizer and image processor of
``tests/engine/vl_helpers.py``): ``response_format`` json_schema, ``tools`` with
``tool_choice`` "required" or a named function (the fake engine answers the constrained
JSON; the reply is a tool call whose arguments match the function's schema), ``n`` > 1,
``logprobs`` and ``stop`` reach the engine with the images on every request. The engine side
(the output under the constraint, speculation) is ``tests/engine/test_qwen_vl_features.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("PIL")

from starlette.testclient import TestClient  # noqa: E402

from engine import io_struct  # noqa: E402
from server.media.fetch import MediaLimits  # noqa: E402
from server.media.process import ImageProcessor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "engine"))
from app_helpers import make_app  # noqa: E402
from vl_helpers import IMAGE_TOKEN_ID, data_url, image_processor, png  # noqa: E402

PARAMS = {"type": "object", "properties": {"shade": {"enum": ["dark", "light"]}},
          "required": ["shade"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "paint", "parameters": PARAMS}}]


@pytest.fixture
def served(tokenizer):
    app, engine = make_app()
    engine.tm.set_tokenizer(tokenizer)
    engine.tm.images = ImageProcessor(image_processor(), IMAGE_TOKEN_ID)
    engine.tm.media_limits = MediaLimits.from_args(engine.tm.args)
    return TestClient(app), engine


def _post(client, **body):
    url = data_url(png())
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "paint "}, {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 20, **body})


def _sent(engine) -> list:
    return [m for m in engine.sent if isinstance(m, io_struct.TokenizedGenerateReq)]


def _with_image(msg) -> bool:
    return len(msg.images) == 1 and msg.input_ids.count(IMAGE_TOKEN_ID) == msg.images[0].length


def test_response_format_with_an_image(served):
    client, engine = served
    engine.text = '{"shade": "dark"}'
    r = _post(client, response_format={"type": "json_schema", "json_schema": {
        "name": "paint", "schema": PARAMS}})
    assert r.status_code == 200, r.text
    (msg,) = _sent(engine)
    assert _with_image(msg) and json.loads(msg.sampling_params.json_schema) == PARAMS
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"shade": "dark"}


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "paint"}}])
def test_forced_tool_call_with_an_image(served, choice):
    client, engine = served
    named = isinstance(choice, dict)
    engine.text = ('{"shade": "light"}' if named
                   else '[{"name": "paint", "parameters": {"shade": "light"}}]')
    r = _post(client, tools=TOOLS, tool_choice=choice)
    assert r.status_code == 200, r.text
    (msg,) = _sent(engine)
    assert _with_image(msg) and msg.sampling_params.json_schema
    choice0 = r.json()["choices"][0]
    (call,) = choice0["message"]["tool_calls"]
    assert call["function"]["name"] == "paint"
    assert json.loads(call["function"]["arguments"]) == {"shade": "light"}


def test_n_logprobs_and_stop_with_an_image(served):
    client, engine = served
    r = _post(client, n=3, logprobs=True, top_logprobs=2, stop=["\n\n", "END"])
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    sent = _sent(engine)
    assert len(sent) == 3 and all(_with_image(m) for m in sent)
    assert {m.sampling_params.logprobs for m in sent} == {2}
    assert all(m.sampling_params.stop == ["\n\n", "END"] for m in sent)
