"""API key (401), queue full (503), requests that can never fit (400), stalled clients (408,
closed connections) and graceful shutdown (SIGTERM) of a real server.

The server admits at most one running plus one queued request, waits 2 s for a request's
headers and 2 s for its body, and 10 ms for a constraint to compile; the module's last test stops it with SIGTERM and checks the drain: new requests 503,
the in-flight stream ends with ``finish_reason`` "abort" and ``[DONE]``, exit code 0, no
child process and no IPC dir left.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

KEY = "sk-test-ferry"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 2.0
SERVER_ARGS = ["--max-total-tokens", "4096", "--api-key", KEY, "--max-running-requests", "1",
               "--max-queued-requests", "1", "--shutdown-timeout", "3",
               "--body-read-timeout", str(BODY_TIMEOUT_S), "--header-timeout",
               str(HEADER_TIMEOUT_S), "--grammar-compile-timeout", "0.01"]
LONG = {"prompt": "Count from one to one thousand: one, two,", "max_tokens": 2000,
        "ignore_eos": True, "temperature": 0}


def info(server) -> dict:
    r = httpx.get(server.url + "/server_info", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_api_key(server):
    url = server.url
    for path in ("/v1/models", "/server_info"):
        r = httpx.get(url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + path, headers={"Authorization": "Bearer nope"},
                         timeout=10).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": KEY},  # no scheme
                         timeout=10).status_code == 401
        assert httpx.get(url + path, headers=AUTH, timeout=10).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # stays open
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", timeout=30, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=60, max_retries=0)
    r = good.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1


async def test_queue_full_503(server):
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:
        tasks = [asyncio.create_task(c.post("/v1/completions", json=LONG)) for _ in range(2)]
        deadline = time.monotonic() + 30
        while info(server)["num_inflight"] < 2:
            assert time.monotonic() < deadline, info(server)
            await asyncio.sleep(0.05)
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and "queue" in err["message"]
        for t in tasks:  # the clients leave: both requests are aborted
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + 10
        while (i := info(server))["num_inflight"] or i["kv_used_tokens"]:
            assert time.monotonic() < deadline, i
            await asyncio.sleep(0.05)
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "n": 3}, "n"),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [2]], "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
])
def test_fan_out_beyond_capacity_is_a_400(server, path, body, param):
    # 1 running + 1 queued: more engine requests than that can never be admitted, even idle
    r = httpx.post(server.url + path, json=dict(body, max_tokens=1), headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "at most 2" in err["message"]


def test_fan_out_at_capacity_runs(server):
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Hi", "n": 2, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_past_the_compile_budget_is_a_400(server, stream):
    """Issue 34 kind 3: compile cost grows superlinearly with some schema shapes (hundreds of
    optional properties: seconds of CPU for ~10 KB); past --grammar-compile-timeout the
    request is a 400 naming the limit, stream or not, and the server goes on."""
    schema = {"type": "object", "properties": {f"k{i}_{stream}": {"type": "string"}
                                               for i in range(300)}}
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                  "schema": schema}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("json_schema", "constraint_too_complex"), err
    assert "--grammar-compile-timeout" in err["message"]
    test_fan_out_at_capacity_runs(server)


def _stall(server, n_sockets: int) -> list[socket.socket]:
    """Sockets that sent a request's headers and the start of its body, then stopped."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            '{"prompt": "').encode()
    socks = []
    for _ in range(n_sockets):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        s.sendall(head)
        socks.append(s)
    return socks


def _read_to_eof(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_stalled_clients_are_timed_out(server):
    t0 = time.monotonic()
    socks = _stall(server, 20)
    # and connections that stall before their headers are complete (silent, or half-sent)
    quiet = [socket.create_connection(("127.0.0.1", server.port), timeout=30)
             for _ in range(10)]
    for s in quiet[5:]:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    try:
        # the server is not blocked meanwhile
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert all(_read_to_eof(s) == b"" for s in quiet)  # closed without an answer
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 20
        answers = [_read_to_eof(s) for s in socks]  # EOF: the server closed the connection
    finally:
        for s in socks + quiet:
            s.close()
    waited = time.monotonic() - t0
    assert BODY_TIMEOUT_S <= waited < BODY_TIMEOUT_S + 20
    for a in answers:
        head, _, body = a.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), a[:200]
        assert b"connection: close" in head.lower()
        err = json.loads(body)["error"]
        assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error"
    assert info(server)["num_inflight"] == 0


def test_sigterm_drains_then_exits(server):
    i = info(server)
    pids = [i["engine_pid"], i["detokenizer_pid"]]
    assert all(server.pid_alive(p) for p in pids)
    assert len(server.ipc_dirs()) == 1
    events = []
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=dict(LONG, stream=True)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # draining: new work is refused, the health check says so
        h = httpx.get(server.url + "/health", timeout=10)
        assert h.status_code == 503
        n = httpx.post(server.url + "/v1/completions", headers=AUTH,
                       json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert n.status_code == 503 and "shutting down" in n.json()["error"]["message"]
        t0 = time.monotonic()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: "):])
        waited = time.monotonic() - t0
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert waited < 3 + 5  # --shutdown-timeout 3, then aborted
    assert server.wait(30) == 0, server.log()
    assert not any(server.pid_alive(p) for p in pids)
    assert server.ipc_dirs() == []
