"""Soak with faults (embedded SmolLM2, CPU, 127.0.0.1 only, bounded time).

64 concurrent streaming clients loop for ``SOAK_S`` seconds over ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/responses``; a quarter of them (seeded) leave at random points
(before the answer, after k events, with a FIN or a RST), and raw-socket clients keep
sending faulty requests: bad JSON, a truncated body then a close, a wrong Content-Length, a
stalled body (408), a body over the size limit (413), a trickled body (served), stalled
headers (closed), a garbage request line. ``/health`` is polled throughout.

Asserted invariants (never timings): every request of a client that stayed ended with a
finish reason and ``[DONE]`` (a terminal event for the Responses API), none hung; every
faulty request got its documented answer; ``/health`` answered 200 every time; no 5xx and
no traceback in the server log; once idle, every KV page is free again (``kv_free_tokens ==
kv_total_tokens``; evictable prefix-cache tokens count as free), no request is running,
waiting or tracked by the server, and a fresh request is served.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SERVER_ARGS = ["--body-read-timeout", "3", "--header-timeout", "3",
               "--max-request-bytes", "65536"]
SOAK_S = 30.0            # load phase; each client finishes its current request after it
CLIENTS = 64
LEAVERS = CLIENTS // 4   # clients that disconnect at random points
REQUEST_TIMEOUT_S = 90.0  # a request of a staying client that takes longer is "hung"
IDLE_TIMEOUT_S = 20.0
SEED = int(os.environ.get("FERRY_SOAK_SEED", "1234"))  # another seed, another mix
PROMPTS = ["Say hi.", "Name a fruit.", "Count to three.", "What is 2+2?", "Name a colour.",
           "Say yes.", "Give me a word.", "Name a city."]


def _body(rng: random.Random, kind: str) -> tuple[str, dict]:
    """A small streaming request of endpoint ``kind``: (path, body)."""
    prompt = rng.choice(PROMPTS)
    mt = rng.randint(8, 16)
    temp = rng.choice([0, 0.7])
    if kind == "chat":
        return "/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": mt,
                                        "temperature": temp, "seed": rng.randint(0, 999),
                                        "messages": [{"role": "user", "content": prompt}]}
    if kind == "completions":
        return "/v1/completions", {"model": MODEL, "stream": True, "max_tokens": mt,
                                   "temperature": temp, "prompt": prompt}
    return "/v1/responses", {"model": MODEL, "stream": True, "max_output_tokens": mt,
                             "temperature": temp, "input": prompt}


def _request_bytes(path: str, body: bytes, content_length: int | None = None) -> bytes:
    cl = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {cl}\r\n\r\n").encode() + body


class Stats:
    """What the clients saw."""

    def __init__(self):
        self.served = 0                       # requests of staying clients, complete
        self.left = 0                         # disconnects on purpose
        self.statuses: Counter = Counter()    # HTTP status of every answered request
        self.latencies: list[float] = []
        self.failures: list[str] = []         # invariant violations, with what happened
        self.faults: Counter = Counter()
        self.health_polls = 0
        self.health_failures: list[str] = []


async def _stayer(client: httpx.AsyncClient, rng: random.Random, deadline: float,
                  st: Stats) -> None:
    while time.monotonic() < deadline:
        kind = rng.choice(["chat", "completions", "responses"])
        path, body = _body(rng, kind)
        t0 = time.monotonic()
        finished = done = False
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                async with client.stream("POST", path, json=body) as r:
                    st.statuses[r.status_code] += 1
                    if r.status_code != 200:
                        st.failures.append(f"{kind}: status {r.status_code}: "
                                           f"{(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev or ev.get("type") in ("error", "response.failed"):
                            st.failures.append(f"{kind}: error event {ev}")
                        elif kind == "responses":
                            if ev["type"] in ("response.completed", "response.incomplete"):
                                finished = done = True
                        elif any(c.get("finish_reason") for c in ev.get("choices", [])):
                            finished = True
        except TimeoutError:
            st.failures.append(f"{kind}: hung for {REQUEST_TIMEOUT_S} s")
            continue
        except httpx.HTTPError as exc:
            st.failures.append(f"{kind}: {type(exc).__name__}: {exc}")
            continue
        if not (finished and done):
            st.failures.append(f"{kind}: stream ended without finish/[DONE] "
                               f"(finished={finished}, done={done})")
            continue
        st.served += 1
        st.latencies.append(time.monotonic() - t0)


async def _leaver(port: int, rng: random.Random, deadline: float, st: Stats) -> None:
    """Raw socket clients that leave: before any answer, or after k events; FIN or RST;
    one request in four is not streamed (it leaves while the server generates)."""
    while time.monotonic() < deadline:
        path, body = _body(rng, rng.choice(["chat", "completions", "responses"]))
        # long enough that a request the server failed to abort is still running when the
        # soak ends (the idle check would see it)
        body.update({"ignore_eos": True}, **{"max_output_tokens" if "responses" in path
                                           else "max_tokens": 4096})
        k = rng.choice([0, 0, 1, 2, 3, 5, 8])
        if rng.random() < 0.25:
            body["stream"], k = False, 0
        rst = rng.random() < 0.5
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_request_bytes(path, json.dumps(body).encode()))
            await writer.drain()
            if k:
                seen = 0
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    while seen < k:
                        line = await reader.readline()
                        if not line:
                            break
                        if line.startswith(b"HTTP/1.1 "):
                            st.statuses[int(line.split()[1])] += 1
                        seen += line.startswith(b"data: ")
            else:
                await asyncio.sleep(rng.uniform(0, 0.3))
        finally:
            if rst:
                writer.transport.abort()
            else:
                writer.close()
        st.left += 1
        await asyncio.sleep(rng.uniform(0, 0.5))


async def _status_of(reader: asyncio.StreamReader, timeout: float) -> int | None:
    """The status code of the first response, or None if the server closed first."""
    async with asyncio.timeout(timeout):
        line = await reader.readline()
    return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else None


async def _fault(port: int, kind: str, st: Stats) -> None:
    """One faulty request; a violated expectation goes to ``st.failures``."""
    ok_body = json.dumps({"model": MODEL, "max_tokens": 4, "stream": True, "messages": [
        {"role": "user", "content": "Hi"}]}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    want: int | None = None
    got: int | None = None
    try:
        if kind == "bad_json":
            want = 400
            writer.write(_request_bytes("/v1/chat/completions", b'{"messages": [{"role":'))
            got = await _status_of(reader, 30)
        elif kind == "truncated_close":  # half the body, then gone: nothing to answer
            writer.write(_request_bytes("/v1/chat/completions", ok_body[:20], len(ok_body)))
            await writer.drain()
            st.faults[kind] += 1
            return
        elif kind == "short_content_length":  # the body is cut where the header says
            want = 400
            writer.write(_request_bytes("/v1/chat/completions", ok_body, len(ok_body) - 7))
            got = await _status_of(reader, 30)
        elif kind == "stalled_body":
            want = 408
            writer.write(_request_bytes("/v1/responses", ok_body[:30], len(ok_body)))
            got = await _status_of(reader, 30)
        elif kind == "too_large":
            want = 413
            writer.write(_request_bytes("/v1/chat/completions", b"", 10**6))
            got = await _status_of(reader, 30)
        elif kind == "garbage":
            want = 400
            writer.write(b"GARBAGE / NOPE\r\n\r\n")
            got = await _status_of(reader, 30)
        elif kind == "trickle":  # a whole body, 8 bytes every 20 ms: served in full
            want = 200
            data = _request_bytes("/v1/chat/completions", ok_body)
            for i in range(0, len(data), 8):
                writer.write(data[i:i + 8])
                await writer.drain()
                await asyncio.sleep(0.02)
            got = await _status_of(reader, REQUEST_TIMEOUT_S)
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                rest = await reader.read(1 << 20)
                while b"data: [DONE]" not in rest:
                    more = await reader.read(1 << 20)
                    if not more:
                        break
                    rest += more
            if b'"finish_reason":"' not in rest or b"data: [DONE]" not in rest:
                st.failures.append(f"trickle: incomplete stream {rest[-300:]!r}")
        elif kind == "stalled_headers":  # closed by --header-timeout, no answer
            want = None
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            got = await _status_of(reader, 30)
        st.faults[kind] += 1
        if got != want:
            st.failures.append(f"fault {kind}: got status {got}, want {want}")
        if got is not None:
            st.statuses[got] += 1
    except TimeoutError:
        st.failures.append(f"fault {kind}: no answer (hung)")
    finally:
        writer.transport.abort()


async def _faulty(port: int, rng: random.Random, deadline: float, st: Stats) -> None:
    kinds = ["bad_json", "truncated_close", "short_content_length", "stalled_body",
             "too_large", "garbage", "trickle", "stalled_headers"]
    while time.monotonic() < deadline:
        await _fault(port, rng.choice(kinds), st)
        await asyncio.sleep(rng.uniform(0, 0.5))


async def _health(url: str, stop: asyncio.Event, st: Stats) -> None:
    async with httpx.AsyncClient(timeout=10.0) as c:
        while not stop.is_set():
            try:
                r = await c.get(url + "/health")
                if r.status_code != 200:
                    st.health_failures.append(f"status {r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as exc:
                st.health_failures.append(f"{type(exc).__name__}: {exc}")
            st.health_polls += 1
            await asyncio.sleep(0.25)


async def _soak(url: str, port: int) -> Stats:
    st = Stats()
    rng = random.Random(SEED)
    deadline = time.monotonic() + SOAK_S
    stop = asyncio.Event()
    health = asyncio.create_task(_health(url, stop, st))
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S,
                                 limits=limits) as client:
        tasks = [_leaver(port, random.Random(rng.random()), deadline, st)
                 if i < LEAVERS else
                 _stayer(client, random.Random(rng.random()), deadline, st)
                 for i in range(CLIENTS)]
        tasks += [_faulty(port, random.Random(rng.random()), deadline, st) for _ in range(3)]
        await asyncio.gather(*tasks)
    stop.set()
    await health
    return st


def _idle_info(url: str) -> dict:
    """``/server_info`` once nothing runs and the KV pool is whole (or the last one)."""
    t_end = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        info = httpx.get(url + "/server_info", timeout=10).json()
        if ((info["num_running"], info["num_waiting"], info["kv_used_tokens"],
             info["num_inflight"]) == (0, 0, 0, 0)
                and info["kv_free_tokens"] == info["kv_total_tokens"]) \
                or time.monotonic() > t_end:
            return info
        time.sleep(0.2)


def test_soak_with_faults(server):
    before = httpx.get(server.url + "/server_info", timeout=10).json()
    t0 = time.monotonic()
    st = asyncio.run(_soak(server.url, server.port))
    load_s = time.monotonic() - t0
    info = _idle_info(server.url)
    lat = sorted(st.latencies)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    print(f"\nsoak: {load_s:.1f} s, {st.served} requests served, {st.left} disconnects, "
          f"faults {dict(st.faults)}, statuses {dict(sorted(st.statuses.items()))}, "
          f"p50 {lat[len(lat) // 2] if lat else float('nan'):.2f} s, p99 {p99:.2f} s, "
          f"health polls {st.health_polls}, failures {len(st.failures)}")
    keys = ("kv_used_tokens", "kv_free_tokens", "kv_total_tokens", "cached_tokens",
            "evictable_tokens", "num_running", "num_waiting", "num_inflight")
    print("idle:", {k: info.get(k) for k in keys})
    assert not st.failures, st.failures[:10]
    assert not st.health_failures, st.health_failures[:10]
    assert st.served > CLIENTS and st.left > LEAVERS and st.health_polls > 10
    assert all(s < 500 for s in st.statuses), st.statuses
    assert (info["num_running"], info["num_waiting"], info["num_inflight"]) == (0, 0, 0), info
    assert info["kv_used_tokens"] == 0, info
    assert info["kv_free_tokens"] == info["kv_total_tokens"] == before["kv_total_tokens"], info
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop",
                                                                                "length")
