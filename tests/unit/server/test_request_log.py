"""What ``--log-requests`` logs (docs/usage.md, "Logs"; issue 34, kind 8: the README said it
logs prompts and outputs, docs/deployment.md that the request log never holds text)."""

from __future__ import annotations

import logging

import httpx
import pytest
from app_helpers import make_app


async def _complete(app) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        r = await c.post("/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 1,
                                                  "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["id"]


@pytest.mark.parametrize("flag", [True, False])
async def test_log_requests(flag, caplog):
    app, _ = make_app(log_requests=flag)
    with caplog.at_level(logging.DEBUG, logger="ferry.server"):
        rid = await _complete(app)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ferry.server"]
    summary = [(lvl, m) for lvl, m in lines if m.startswith(f"rid={rid} ")]
    assert len(summary) == 1
    level, text = summary[0]
    assert level == (logging.INFO if flag else logging.DEBUG)
    assert "prompt_tokens=3 completion_tokens=1" in text and "ok" not in text.split()
    texts = [m for _, m in lines if m.startswith(f"request {rid} ")]
    if flag:  # the prompt and parameters at arrival, the output text at the end
        assert len(texts) == 2
        assert texts[0].startswith(f"request {rid} prompt=[[11, 12, 13]] params=SamplingParams(")
        assert texts[1] == f"request {rid} outputs=['ok']"
    else:
        assert texts == []
