"""SIGTERM to the whole process group (``timeout``, ``kill -- -PGID``, systemd's default
stop): the engine and detokenizer ignore it, so the server still drains. The in-flight
stream finishes normally, the server exits 0 without reporting a dead child."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--max-total-tokens", "4096", "--shutdown-timeout", "30"]


def test_group_sigterm_drains(server):
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    pids = [info["engine_pid"], info["detokenizer_pid"]]
    events = []
    body = {"prompt": "Count to ten: one, two,", "max_tokens": 24, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(line[len("data: "):])
                break
        os.killpg(server.proc.pid, signal.SIGTERM)   # the server and both children
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 1
    assert server.wait(60) == 0, server.log()
    assert "died" not in server.log()
    assert not any(server.pid_alive(p) for p in pids)
