"""Liveness: when the engine process dies, waiting requests fail with a 5xx at once (a
stream gets an error event and ``[DONE]``), /health answers 503, and the server exits
non-zero leaving no child process and no IPC dir behind. Destructive: its own server."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--max-total-tokens", "4096"]
LONG = {"prompt": "Count from one to one thousand: one, two,", "max_tokens": 2000,
        "ignore_eos": True, "temperature": 0}


def test_engine_death_fails_requests_and_exits(server):
    i = httpx.get(server.url + "/server_info", timeout=10).json()
    engine, detok = i["engine_pid"], i["detokenizer_pid"]
    assert server.pid_alive(engine) and server.pid_alive(detok)

    pending: dict = {}

    def non_stream():
        r = httpx.post(server.url + "/v1/completions", json=LONG, timeout=60)
        pending["status"], pending["body"], pending["t"] = r.status_code, r.json(), \
            time.monotonic()

    th = threading.Thread(target=non_stream, daemon=True)
    events = []
    with httpx.Client(timeout=60) as c, \
            c.stream("POST", server.url + "/v1/completions", json=dict(LONG, stream=True)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        th.start()
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/server_info", timeout=10).json()["num_inflight"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t_kill = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: "):])
        t_stream = time.monotonic() - t_kill
        # the server keeps answering for a moment: /health is 503, not a refused connection
        status = None
        while time.monotonic() - t_kill < 10:
            status = httpx.get(server.url + "/health", timeout=5).status_code
            if status != 200:
                break
            time.sleep(0.05)
        assert status == 503
    th.join(30)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "service_unavailable" and "engine" in err["message"]
    assert t_stream < 5
    assert pending["status"] == 503 and pending["body"]["error"]["type"] == "service_unavailable"
    assert pending["t"] - t_kill < 5
    code = server.wait(30)
    assert code is not None and code != 0, server.log()
    assert not server.pid_alive(engine) and not server.pid_alive(detok)
    assert server.ipc_dirs() == []
