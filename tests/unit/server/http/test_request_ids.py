"""X-Request-Id: the client's id becomes the response id, the engine's rid and the response
header; without one the response header is the generated id (the body's id); a reused id
still in flight gets a unique engine rid; a malformed header is a 400. Over a fake engine
(tests/unit/app_helpers.py)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from app_helpers import make_app
from starlette.testclient import TestClient

from server.http.errors import APIError
from server.http.request_id import parse_header

BODY = {"prompt": [1, 2, 3], "max_tokens": 1}


@pytest.fixture
def app_engine():
    return make_app()


@pytest.fixture
def client(app_engine):
    return TestClient(app_engine[0])


def test_header_becomes_the_id_everywhere(client, app_engine):
    eng = app_engine[1]
    r = client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "trace-42/a.b"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-42/a.b"
    assert r.json()["id"] == "trace-42/a.b"
    assert eng.rids == ["trace-42/a.b"]


def test_n_choices_get_derived_engine_ids(client, app_engine):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                    headers={"X-Request-Id": "c1"})
    assert r.status_code == 400  # no tokenizer in the fake: the id still comes back
    assert r.headers["x-request-id"] == "c1"
    r = client.post("/v1/completions", json=dict(BODY, n=3), headers={"X-Request-Id": "multi"})
    assert r.status_code == 200 and r.json()["id"] == "multi"
    assert app_engine[1].rids == ["multi-0", "multi-1", "multi-2"]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]


def test_without_header_the_response_carries_the_generated_id(client, app_engine):
    r = client.post("/v1/completions", json=BODY)
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", rid)
    assert r.json()["id"] == rid and app_engine[1].rids == [rid]
    for path in ("/v1/models", "/health", "/no/such/route"):
        assert re.fullmatch(r"req-[0-9a-f]{32}", client.get(path).headers["x-request-id"])
    # an error of a generation route: the id the route made, the body is OpenAI's error
    r = client.post("/v1/completions", json={"prompt": [1], "temperature": 9})
    assert r.status_code == 400 and re.fullmatch(r"cmpl-[0-9a-f]{32}",
                                                 r.headers["x-request-id"])


def test_errors_and_streams_echo_the_header(client):
    h = {"X-Request-Id": "e-1"}
    for r in (client.post("/v1/completions", json={"prompt": [1], "n": 0}, headers=h),
              client.post("/v1/completions", content=b"{", headers=h),
              client.get("/nope", headers=h), client.delete("/v1/models", headers=h),
              client.post("/v1/completions", content=b"x", headers=dict(
                  h, **{"Content-Type": "text/plain"}))):
        assert r.status_code in (400, 404, 405, 415)
        assert r.headers["x-request-id"] == "e-1" and "error" in r.json()
    with client.stream("POST", "/v1/completions", json=dict(BODY, stream=True),
                       headers={"X-Request-Id": "s-1"}) as r:
        assert r.headers["x-request-id"] == "s-1"
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks and {c["id"] for c in chunks} == {"s-1"}


def test_api_key_refusal_carries_the_id():
    app, _ = make_app(api_key="sekrit")
    r = TestClient(app).get("/v1/models", headers={"X-Request-Id": "k-1"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "k-1"


@pytest.mark.parametrize("value", ["", "a b", "x" * 257, "tab\there", b"caf\xc3\xa9"])
def test_malformed_header_is_a_400(client, value):
    r = client.get("/v1/models", headers=[("X-Request-Id", value)])
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_request_id"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(r"req-[0-9a-f]{32}", r.headers["x-request-id"])


def test_bounds_of_the_header(client):
    longest = "~" * 256
    assert client.get("/v1/models", headers={"X-Request-Id": longest}).headers[
        "x-request-id"] == longest
    r = client.get("/v1/models", headers=[("X-Request-Id", "a"), ("X-Request-Id", "b")])
    assert r.status_code == 400


def test_parse_header():
    assert parse_header([]) is None
    assert parse_header([b"!~"]) == "!~"
    for bad in ([b"a", b"a"], [b""], [b"\x7f"], [b"a\x00"], [b"x" * 257]):
        with pytest.raises(APIError):
            parse_header(bad)


async def test_an_id_reused_while_in_flight_is_made_unique_for_the_engine():
    app, eng = make_app()
    eng.hold = True  # the first request is still running when the second arrives
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as c:
        h = {"X-Request-Id": "dup"}
        first = asyncio.create_task(c.post("/v1/completions", json=BODY, headers=h))
        second = asyncio.create_task(c.post("/v1/completions", json=BODY, headers=h))
        async with asyncio.timeout(10):
            while len(eng.rids) < 2:
                await asyncio.sleep(0.01)
        eng.release()
        r1, r2 = await first, await second
    assert eng.rids[0] == "dup" and re.fullmatch(r"dup-[0-9a-f]{8}", eng.rids[1])
    for r in (r1, r2):
        assert r.status_code == 200
        assert r.json()["id"] == "dup" and r.headers["x-request-id"] == "dup"
    assert app_tm_idle(eng)


def app_tm_idle(eng) -> bool:
    """Nothing left registered in the TokenizerManager."""
    return eng.tm.states == {}
