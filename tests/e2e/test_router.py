"""Issue 27, item 6 (the router part): two ferry replicas (the embedded SmolLM2 on the CPU, one
intra-op thread each) behind sglang-router 0.3.2 (``--policy cache_aware``), as
docs/deployment.md sets them up.

- The router registers both (its /workers shows the served model name) and the OpenAI
  routes work through it: chat, completions, streaming, tools, the Responses API.
- Prefix affinity: four long system prompts, each sent once, then twice more in a row with
  new questions. Under cache_aware both repeats go to the replica that holds the prompt, so at
  least 0.8 of their prompt tokens come from a replica's prefix cache (Δ
  ``prefix_cache_hits`` / Δ ``prefix_cache_queries`` of /server_info over both replicas);
  the same workload under round_robin sends one repeat of each pair to the other replica
  (about 0.5), which shows the measure measures something.
- One replica SIGKILLed (its whole process group, as a host dies) while requests run: the
  other's requests finish and reach their clients, every request ends within its timeout,
  the router marks the dead one unhealthy, and new requests all go to the survivor.

Every wait is bounded: requests have timeouts, the router its request timeout and few fast
retries, polls a deadline. Runs in about two minutes on two busy cores.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from api_helpers import openai_tour
from conftest import FerryServer, free_port

pytestmark = pytest.mark.slow
pytest.importorskip("sglang_router")

MODEL = "SmolLM2-135M-Instruct"
REPLICA_ARGS = ["--max-total-tokens", "4096", "--cpu-threads", "1"]
TIMEOUT_S = 60.0            # any one request through the router
ROUTER_START_S = 60.0
#: the router flags that matter for ferry replicas (docs/deployment.md explains each)
ROUTER_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-check-timeout-secs", "2", "--request-timeout-secs", "60",
                "--retry-max-retries", "2", "--retry-initial-backoff-ms", "50",
                "--retry-max-backoff-ms", "500", "--worker-startup-timeout-secs", "60",
                "--worker-startup-check-interval", "1", "--log-level", "warn"]
WORDS = ("river mountain copper lantern harbor orchard meadow glacier canyon falcon willow "
         "ember prairie beacon thicket quarry marsh summit valley cedar basalt tundra").split()


class Router:
    """One sglang-router process in front of ``workers`` (its own session, stopped by
    SIGTERM, then SIGKILL)."""

    def __init__(self, tmp: Path, workers: list[str], policy: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"router-{policy}.log"
        self.cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                    "--port", str(self.port), "--prometheus-port", str(free_port()),
                    "--policy", policy, "--worker-urls", *workers, *ROUTER_FLAGS]
        self.workers = workers
        self.proc: subprocess.Popen | None = None

    def start(self) -> Router:
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + ROUTER_START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            with contextlib.suppress(httpx.HTTPError):
                if len(self.healthy()) == len(self.workers):
                    return self
            time.sleep(0.5)
        raise AssertionError(f"the router did not register its workers:\n{self.log()}")

    def healthy(self) -> list[str]:
        """The URLs of the workers the router deems healthy."""
        ws = httpx.get(self.url + "/workers", timeout=5).json()["workers"]
        return sorted(w["url"] for w in ws if w["is_healthy"])

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two ferry servers, started side by side."""
    servers = [FerryServer(tmp_path_factory.mktemp(f"replica{i}"), REPLICA_ARGS)
               for i in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(FerryServer.start, servers))
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    r = Router(tmp_path_factory.mktemp("router"), [s.url for s in replicas], "cache_aware")
    r.start()
    yield r
    r.stop()


def _chat(url: str, system: str, question: str, max_tokens: int = 1, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": question}], **kw})


def test_the_router_registers_the_replicas_by_model_name(router, replicas):
    ws = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
    assert sorted(w["url"] for w in ws) == sorted(s.url for s in replicas)
    assert {w["model_id"] for w in ws} == {MODEL}
    models = httpx.get(router.url + "/v1/models", timeout=5).json()["data"]
    assert [m["id"] for m in models] == [MODEL]


def test_openai_routes_through_the_router(router):
    client, r, chunks, t, resp = openai_tour(router.url, TIMEOUT_S)
    c = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4,
                                  temperature=0)
    assert c.choices[0].text and c.usage.prompt_tokens >= 2
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert t.choices[0].finish_reason == "tool_calls"
    assert resp.status in ("completed", "incomplete") and resp.output_text
    assert resp.store is True  # stored by the ferry server that answered (issue 28)
    events = [e.type for e in client.responses.create(model=MODEL, input="Hi", stream=True,
                                                      max_output_tokens=3)]
    assert events[0] == "response.created" and events[-1] in ("response.completed",
                                                               "response.incomplete")
    # a body without a model: the router writes "unknown", ferry takes it as absent
    r2 = httpx.post(router.url + "/v1/chat/completions", timeout=TIMEOUT_S,
                    json={"messages": [{"role": "user", "content": "Name a colour."}],
                          "max_tokens": 2})
    assert r2.status_code == 200, r2.text


def _system_prompts(n: int, words: int = 220) -> list[str]:
    """``n`` long system prompts that differ from their first word on."""
    rng = random.Random(27)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + f" You are helper {k}."
            for k in range(n)]


def _cache_counts(replicas) -> tuple[int, int]:
    """(prompt tokens looked up in the prefix cache, tokens found) summed over replicas."""
    q = h = 0
    for s in replicas:
        stats = httpx.get(s.url + "/server_info", timeout=10).json()["stats"]
        q += stats["prefix_cache_queries"]
        h += stats["prefix_cache_hits"]
    return q, h


def _affinity_share(url: str, replicas) -> float:
    """Warm each system prompt once, then send each twice in a row with new questions: the
    share of the repeats' prompt tokens served from a replica's prefix cache."""
    for s in replicas:
        assert httpx.post(s.url + "/flush_cache", timeout=10).status_code == 200
    systems = _system_prompts(4)
    for k, system in enumerate(systems):
        assert _chat(url, system, f"Question {k}?").status_code == 200
    q0, h0 = _cache_counts(replicas)
    for k, system in enumerate(systems):
        for j in range(2):
            assert _chat(url, system, f"Another question {k}.{j}?").status_code == 200
    q1, h1 = _cache_counts(replicas)
    assert q1 - q0 > 8 * 200  # the repeats' prompts were looked up
    return (h1 - h0) / (q1 - q0)


def test_prefix_affinity_cache_aware_vs_round_robin(router, replicas, tmp_path):
    share = _affinity_share(router.url, replicas)
    rr = Router(tmp_path, [s.url for s in replicas], "round_robin").start()
    try:
        rr_share = _affinity_share(rr.url, replicas)
    finally:
        rr.stop()
    print(f"prefix-cache share of the repeats: cache_aware {share:.2f}, "
          f"round_robin {rr_share:.2f}")
    assert share >= 0.8
    assert rr_share < 0.7


def _finished(server) -> float:
    """Requests the server finished (ferry:request_success_total over its reasons)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ferry:request_success_total{"))


def test_a_replica_killed_with_sigkill(router, replicas):
    dead, alive = replicas
    systems = _system_prompts(6, words=40)
    done_before = _finished(alive)
    results: list = [None] * len(systems)
    started = threading.Barrier(len(systems) + 1, timeout=30)

    def run(i: int) -> None:
        started.wait()
        t0 = time.monotonic()
        try:
            r = _chat(router.url, systems[i], "Count to one hundred.", max_tokens=48,
                      ignore_eos=True)
            results[i] = (r.status_code, time.monotonic() - t0)
        except httpx.HTTPError as exc:
            results[i] = (type(exc).__name__, time.monotonic() - t0)

    threads = [threading.Thread(target=run, args=(i,), daemon=True)
               for i in range(len(systems))]
    for th in threads:
        th.start()
    started.wait()
    # kill the replica once it has requests running (a host dying mid-run)
    deadline = time.monotonic() + 30
    while httpx.get(dead.url + "/server_info", timeout=10).json()["num_inflight"] == 0:
        assert time.monotonic() < deadline, "no request reached the replica"
        time.sleep(0.05)
    os.killpg(dead.proc.pid, signal.SIGKILL)
    for th in threads:
        th.join(TIMEOUT_S + 15)
        assert not th.is_alive(), "a request through the router hangs"
    ok = [r for r in results if r[0] == 200]
    print("results:", results)
    assert all(r is not None and r[1] < TIMEOUT_S + 5 for r in results)
    # every request the survivor finished reached its client (a retried one included)
    assert len(ok) == _finished(alive) - done_before >= 1
    # the router takes the dead replica out; new requests all go to the survivor
    deadline = time.monotonic() + 30
    while dead.url in router.healthy():
        assert time.monotonic() < deadline, "the router still deems the dead replica healthy"
        time.sleep(0.2)
    before = _finished(alive)
    for system in systems:  # their prefixes were spread over both replicas
        r = _chat(router.url, system, "One more question.", max_tokens=2)
        assert r.status_code == 200, r.text
    assert _finished(alive) - before == len(systems)
    assert router.proc.poll() is None
