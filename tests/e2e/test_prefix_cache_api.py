"""The radix prefix cache through HTTP: ``usage.prompt_tokens_details.cached_tokens``, the
``ferry:prefix_cache_*`` counters, ``/server_info`` and ``POST /flush_cache``, and the two
prefix-sharing workloads of ``ferry bench-serving`` at CPU size."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
from api_helpers import MODEL, chat, comp, post, stream_chunks
from test_metrics_api import scrape, value

pytestmark = pytest.mark.slow


def _fresh_ids(n: int, seed: int) -> list[int]:
    """A token-id prompt no other test sends (so nothing of it is cached yet)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def test_cached_tokens_in_usage_and_counters(shared_server):
    url = shared_server.url
    ids = _fresh_ids(40, seed=int(time.time()))
    before = scrape(url)
    a = comp(url, ids, max_tokens=3, ignore_eos=True)
    b = comp(url, ids, max_tokens=3, ignore_eos=True)
    chunks = stream_chunks(url, "/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    after = scrape(url)
    assert a["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # all but the last prompt token (its logits are sampled) come from the cache
    assert b["usage"]["prompt_tokens_details"] == {"cached_tokens": 39}
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 39}
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    moved = {k: value(after, f"ferry:prefix_cache_{k}_total")
             - value(before, f"ferry:prefix_cache_{k}_total") for k in ("queries", "hits")}
    assert moved == {"queries": 3 * 40, "hits": 2 * 39}


def test_chat_turn_two_reuses_turn_one(shared_server):
    url = shared_server.url
    msgs = [{"role": "system", "content": f"Session {time.time()}: answer briefly."},
            {"role": "user", "content": "Name a colour."}]
    one = chat(url, msgs, max_tokens=8)
    msgs += [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And another one?"}]
    two = chat(url, msgs, max_tokens=8)
    # turn 2 repeats turn 1's prompt: at least that much is cached
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        one["usage"]["prompt_tokens"] - 1


def test_flush_cache_and_server_info(shared_server):
    url = shared_server.url
    ids = _fresh_ids(30, seed=7)
    comp(url, ids, max_tokens=2)
    info = httpx.get(url + "/server_info", timeout=10).json()
    assert info["cached_tokens"] >= 29 and info["evictable_tokens"] == info["cached_tokens"]
    # idle: nothing is held by a request, the evictable cache counts as free
    assert info["kv_used_tokens"] == 0 and info["kv_free_tokens"] == info["kv_total_tokens"]

    # refused while a request runs
    started = threading.Event()

    def long_stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Count:", "max_tokens": 60, "ignore_eos": True,
                "stream": True}) as r:
            for _ in r.iter_lines():
                started.set()

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60)
    r = httpx.post(url + "/flush_cache", timeout=10)
    t.join(120)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "running" in r.json()["error"]["message"]

    held = httpx.get(url + "/server_info", timeout=10).json()["cached_tokens"]
    r = httpx.post(url + "/flush_cache", timeout=10)
    assert r.status_code == 200, r.text
    assert f"({held} cached tokens freed)" in r.json()["message"]
    info = httpx.get(url + "/server_info", timeout=10).json()
    assert info["cached_tokens"] == 0 and info["radix_cache"] is True and "rid" not in info
    again = comp(url, ids, max_tokens=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert httpx.get(url + "/flush_cache", timeout=10).status_code == 405


def test_bench_serving_prefix_workloads(shared_server, capsys):
    from bench.serving import bench_serving as bs

    base = ["--base-url", shared_server.url, "--seed", "11", "--timeout", "120"]
    gsp = bs.run(base + ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
                         "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "48",
                         "--gsp-question-len", "4", "--gsp-output-len", "2"])
    assert gsp["completed"] == 6 and gsp["failed"] == 0
    ideal = 2 * 2 * 48  # every prompt after the first of its group hits the system prompt
    assert gsp["cached_input_tokens"] >= 0.97 * ideal
    assert gsp["server_cache_hit_rate"] == pytest.approx(gsp["cached_input_tokens"] / (6 * 52))
    mt = bs.run(base + ["--dataset-name", "multi-turn", "--mt-conversations", "2",
                        "--mt-turns", "3", "--mt-user-len", "12", "--mt-output-len", "4"])
    assert mt["completed"] == 6 and mt["failed"] == 0
    assert set(mt["turn_ttft_ms"]) == {"1", "2", "3"}
    later = [r for r in mt["records"] if r["turn"] > 1]
    assert all(r["cached_tokens"] > 0 for r in later)
    out = capsys.readouterr().out
    assert "Prefix cache hit rate (server)" in out and "Median TTFT turn 3 (ms)" in out


#: the ``server`` fixture: the cache turned off; the session's server of these args, shared
#: with test_stream_differential.py (no cache: the counters checked here cannot move)
SERVER_ARGS = ["--max-total-tokens", "8192", "--disable-radix-cache"]
SERVER_SHARED = True


def test_disabled_cache_reports_no_hits(server):
    ids = _fresh_ids(20, seed=3)
    comp(server.url, ids, max_tokens=2)
    b = comp(server.url, ids, max_tokens=2)
    assert b["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert value(scrape(server.url), "ferry:prefix_cache_queries_total") == 0
    r = post(server.url, "/flush_cache", {})
    assert r.status_code == 200 and "disabled" in r.json()["message"]
    assert httpx.get(server.url + "/server_info", timeout=10).json()["radix_cache"] is False
