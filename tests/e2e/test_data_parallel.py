"""Issue 27, items 4 and 6 (the ``--dp-size`` part): one ferry server with two engine replicas
(the embedded SmolLM2 on the CPU, one intra-op thread each).

- Chat, completions, streaming, tools and the Responses API through it; /server_info has a
  ``replicas`` list and the sums, /metrics the per-replica gauges, /health says "ok".
- Prefix affinity: four long system prompts, each sent once, then twice more in a row with
  new questions: under ``prefix_affinity`` at least 0.8 of the repeats' prompt tokens come
  from a replica's prefix cache (Δ ``prefix_cache_hits`` / Δ ``prefix_cache_queries`` of
  /server_info, summed over the replicas); under ``round_robin`` about 0.5.
- One replica's engine SIGKILLed while streams run on both: the survivor's streams finish,
  the dead one's end with an error event and ``[DONE]``, nothing hangs, /health answers 200
  "degraded" naming it, and new requests all go to the survivor.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from api_helpers import openai_tour
from conftest import FerryServer
from test_router import MODEL, _affinity_share, _chat, _system_prompts

pytestmark = pytest.mark.slow

DP_ARGS = ["--dp-size", "2", "--max-total-tokens", "4096", "--cpu-threads", "1"]
TIMEOUT_S = 60.0


def _start(tmp_path_factory, name: str, extra: list[str]) -> FerryServer:
    return FerryServer(tmp_path_factory.mktemp(name), DP_ARGS + extra).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = _start(tmp_path_factory, "dp", [])
    yield s
    s.stop()


def _info(s: FerryServer) -> dict:
    return httpx.get(s.url + "/server_info", timeout=10).json()


def test_openai_routes_and_the_figures(server):
    client, _, _, _, resp = openai_tour(server.url, TIMEOUT_S)
    # issue 28: the Responses store lives in the one HTTP process, so a continuation works
    # whichever replica answered each turn; its prompt is the whole conversation
    more = client.responses.create(model=MODEL, input="And another?", max_output_tokens=4,
                                   temperature=0, previous_response_id=resp.id)
    assert more.previous_response_id == resp.id
    assert more.usage.input_tokens > resp.usage.input_tokens + resp.usage.output_tokens
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    c = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4,
                                  temperature=0, n=2)
    assert len(c.choices) == 2 and c.choices[0].text == c.choices[1].text
    info = _info(server)
    assert info["dp_size"] == 2 and info["load_balance_method"] == "prefix_affinity"
    reps = info["replicas"]
    assert [x["index"] for x in reps] == [0, 1] and all(x["alive"] for x in reps)
    assert len({x["engine_pid"] for x in reps}) == 2
    # issue 41 item 5a: the top-level pids are every replica's, not replica 0's
    assert info["engine_pid"] == [x["engine_pid"] for x in reps]
    assert info["detokenizer_pid"] == [x["detokenizer_pid"] for x in reps]
    assert all(x["kv_total_tokens"] > 0 and "tensor_parallel" in x for x in reps)
    for key in ("kv_total_tokens", "num_running", "num_waiting"):
        assert info[key] == sum(x[key] for x in reps)
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert f'ferry:dp_replica_up{{model_name="{MODEL}",replica="1"}} 1' in metrics
    assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"


def test_prefix_affinity_vs_round_robin(server, tmp_path_factory):
    share = _affinity_share(server.url, [server])
    rr = _start(tmp_path_factory, "dp-rr", ["--load-balance-method", "round_robin"])
    try:
        rr_share = _affinity_share(rr.url, [rr])
    finally:
        rr.stop()
    print(f"prefix-cache share of the repeats: prefix_affinity {share:.2f}, "
          f"round_robin {rr_share:.2f}")
    assert share >= 0.8
    assert rr_share < 0.7


def _stream(url: str, system: str, out: list, i: int) -> None:
    t0 = time.monotonic()
    events = []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
                "model": MODEL, "max_tokens": 48, "ignore_eos": True, "stream": True,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "Count to one hundred."}]}) as r:
            if r.status_code != 200:  # failed before its first token: a JSON error, no stream
                out[i] = ({"status": r.status_code, **json.loads(r.read())},
                          time.monotonic() - t0)
                return
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        out[i] = (events, time.monotonic() - t0)
    except httpx.HTTPError as exc:
        out[i] = (type(exc).__name__, time.monotonic() - t0)


def test_a_replica_killed_with_sigkill(server):
    systems = _system_prompts(6, words=40)
    results: list = [None] * len(systems)
    threads = [threading.Thread(target=_stream, args=(server.url, s, results, i), daemon=True)
               for i, s in enumerate(systems)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 30
    while not all(x["num_inflight"] for x in _info(server)["replicas"]):
        assert time.monotonic() < deadline, "the requests did not reach both replicas"
        time.sleep(0.05)
    victim = _info(server)["replicas"][1]["engine_pid"]
    os.kill(victim, signal.SIGKILL)
    for th in threads:
        th.join(TIMEOUT_S + 15)
        assert not th.is_alive(), "a stream hangs"
    finished = errors = 0
    for events, took in results:
        if isinstance(events, dict):  # the replica died before this request's first token
            message = (events.get("error") or {}).get("message", "")
            assert took < TIMEOUT_S and (events["status"] == 503 or "replica 1" in message), \
                events
            errors += 1
            continue
        assert isinstance(events, list), events
        assert took < TIMEOUT_S and events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        if "error" in last:
            errors += 1
            assert last["error"]["code"] == 503 or "replica 1" in last["error"]["message"]
        else:
            finished += 1
    print(f"finished {finished}, failed {errors}")
    assert finished >= 1 and errors >= 1
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert [x["alive"] for x in health.json()["replicas"]] == [True, False]
    for system in systems:
        r = _chat(server.url, system, "One more question.", max_tokens=2)
        assert r.status_code == 200, r.text
    info = _info(server)
    assert info["replicas"][1]["alive"] is False and "replica 1" in info["replicas"][1]["error"]
    assert server.proc.poll() is None
