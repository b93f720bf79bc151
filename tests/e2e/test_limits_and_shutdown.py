"""API key (401), queue full (503) and graceful shutdown (SIGTERM) of a real server.

The server admits at most one running plus one queued request; the module's last test
stops it with SIGTERM and checks the drain: new requests 503, the in-flight stream ends with
``finish_reason`` "abort" and ``[DONE]``, exit code 0, no child process and no IPC dir left.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

KEY = "sk-test-ferry"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVER_ARGS = ["--max-total-tokens", "4096", "--api-key", KEY, "--max-running-requests", "1",
               "--max-queued-requests", "1", "--shutdown-timeout", "3"]
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
