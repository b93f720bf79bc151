"""GET /metrics after a few requests: the counters move by exactly what the requests did
(token counts from each response's usage, finish reasons from its choices)."""

from __future__ import annotations

import httpx
import pytest
from api_helpers import MODEL, chat, comp
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    labels.setdefault("model_name", MODEL)
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_move_by_the_requests(shared_server):
    url = shared_server.url
    before = scrape(url)
    a = comp(url, "The capital of France is", max_tokens=5, ignore_eos=True)
    b = chat(url, [{"role": "user", "content": "Say hi."}], max_tokens=40)
    c = comp(url, "1, 2, 3,", max_tokens=3, n=2, ignore_eos=True)
    after = scrape(url)
    # n=2 runs the prompt twice in the engine: usage counts it once, the metrics twice
    prompt = (a["usage"]["prompt_tokens"] + b["usage"]["prompt_tokens"]
              + 2 * c["usage"]["prompt_tokens"])
    gen = (a["usage"]["completion_tokens"] + b["usage"]["completion_tokens"]
           + c["usage"]["completion_tokens"])
    reasons = [ch["finish_reason"] for r in (a, b, c) for ch in r["choices"]]
    assert value(after, "ferry:generation_tokens_total") - value(
        before, "ferry:generation_tokens_total") == gen
    assert value(after, "ferry:prompt_tokens_total") - value(
        before, "ferry:prompt_tokens_total") == prompt
    for reason in set(reasons):
        moved = (value(after, "ferry:request_success_total", finished_reason=reason)
                 - value(before, "ferry:request_success_total", finished_reason=reason))
        assert moved == reasons.count(reason), reason
    for hist in ("ferry:e2e_request_latency_seconds", "ferry:time_to_first_token_seconds",
                 "ferry:request_queue_time_seconds"):  # the engine reports each queue time
        moved = value(after, hist + "_count") - value(before, hist + "_count")
        assert moved == len(reasons), hist


def test_prompt_token_counts_of_metrics_and_server_info(shared_server):
    """The two prompt-token counters mean different things (docs/usage.md, endpoints, and
    docs/deployment.md, metrics): ``ferry:prompt_tokens_total`` sums ``usage.prompt_tokens``
    of finished requests, prefix-cache hits included; ``/server_info``'s
    ``stats.prompt_tokens`` counts the prompt tokens the engine computed (prefill), so a
    prompt found in the cache adds only its uncached tail."""
    url = shared_server.url

    def computed() -> int:
        return httpx.get(url + "/server_info", timeout=10).json()["stats"]["prompt_tokens"]

    before, computed_before = scrape(url), computed()
    prompt = "Counting prompt tokens twice: the second time the prefix cache holds most."
    runs = [comp(url, prompt, max_tokens=2, ignore_eos=True) for _ in range(2)]
    after, computed_after = scrape(url), computed()
    usage = [r["usage"] for r in runs]
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] > 0  # a prefix-cache hit
    assert (value(after, "ferry:prompt_tokens_total")
            - value(before, "ferry:prompt_tokens_total")) == sum(u["prompt_tokens"] for u in usage)
    assert computed_after - computed_before == sum(
        u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usage)
