"""server/metrics.py: feed known events, parse the exposition text, check exact movements.

Expected values are computed by hand from the events fed in (sums, counts, bucket counts).
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.io_struct import ServerInfoOut, StatsOut
from server.metrics import Metrics, format_request_log, token_buckets

MODEL = "smollm2-test"


def samples(m: Metrics) -> dict[tuple[str, frozenset], float]:
    """Render and parse: {(sample name, frozenset(labels.items())): value}."""
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode("utf-8")):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(snap, name: str, **labels) -> float:
    labels.setdefault("model_name", MODEL)
    return snap[(name, frozenset(labels.items()))]


def fresh() -> Metrics:
    return Metrics(MODEL, max_context_len=8192, include_process_metrics=False)


def test_three_requests_move_counters_and_histograms_exactly():
    m = fresh()
    before = samples(m)
    # A: stop, 10 prompt / 5 generated, TTFT 50 ms, E2E 450 ms, queued 10 ms, 4 ITLs of 100 ms
    m.on_request_finished(finish_reason="stop", prompt_tokens=10, completion_tokens=5,
                          ttft_s=0.05, e2e_s=0.45, queue_s=0.01, itl_s=[0.1] * 4)
    # B: length, 7 prompt / 1 generated, TTFT = E2E = 200 ms, queue unknown
    m.on_request_finished(finish_reason="length", prompt_tokens=7, completion_tokens=1,
                          ttft_s=0.2, e2e_s=0.2, queue_s=None, itl_s=[])
    # C: aborted before any token
    m.on_request_finished(finish_reason="abort", prompt_tokens=3, completion_tokens=0,
                          ttft_s=None, e2e_s=0.03)
    after = samples(m)

    def delta(name, **labels):
        return val(after, name, **labels) - val(before, name, **labels)

    assert delta("ferry:prompt_tokens_total") == 20
    assert delta("ferry:generation_tokens_total") == 6
    for reason in ("stop", "length", "abort"):
        assert delta("ferry:request_success_total", finished_reason=reason) == 1

    # TTFT: A and B only (C produced no token)
    assert val(after, "ferry:time_to_first_token_seconds_count") == 2
    assert val(after, "ferry:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert val(after, "ferry:time_to_first_token_seconds_bucket", le="0.04") == 0
    assert val(after, "ferry:time_to_first_token_seconds_bucket", le="0.06") == 1
    assert val(after, "ferry:time_to_first_token_seconds_bucket", le="0.25") == 2
    assert val(after, "ferry:time_to_first_token_seconds_bucket", le="+Inf") == 2
    # ITL: four samples of 0.1 s
    assert val(after, "ferry:inter_token_latency_seconds_count") == 4
    assert val(after, "ferry:inter_token_latency_seconds_sum") == pytest.approx(0.4)
    assert val(after, "ferry:inter_token_latency_seconds_bucket", le="0.075") == 0
    assert val(after, "ferry:inter_token_latency_seconds_bucket", le="0.1") == 4
    # per-request TPOT: only A has >1 token: (0.45 - 0.05) / (5 - 1) = 0.1
    assert val(after, "ferry:request_time_per_output_token_seconds_count") == 1
    assert val(after, "ferry:request_time_per_output_token_seconds_sum") == pytest.approx(0.1)
    # E2E: all three
    assert val(after, "ferry:e2e_request_latency_seconds_count") == 3
    assert val(after, "ferry:e2e_request_latency_seconds_sum") == pytest.approx(0.68)
    assert val(after, "ferry:e2e_request_latency_seconds_bucket", le="0.05") == 1
    assert val(after, "ferry:e2e_request_latency_seconds_bucket", le="0.3") == 2
    assert val(after, "ferry:e2e_request_latency_seconds_bucket", le="0.5") == 3
    # queue: A only
    assert val(after, "ferry:request_queue_time_seconds_count") == 1
    assert val(after, "ferry:request_queue_time_seconds_sum") == pytest.approx(0.01)
    # per-request token histograms: prompts 10, 7, 3 ; generations 5, 1, 0
    assert val(after, "ferry:request_prompt_tokens_count") == 3
    assert val(after, "ferry:request_prompt_tokens_sum") == 20
    assert val(after, "ferry:request_prompt_tokens_bucket", le="5.0") == 1
    assert val(after, "ferry:request_prompt_tokens_bucket", le="10.0") == 3
    assert val(after, "ferry:request_generation_tokens_bucket", le="1.0") == 2
    assert val(after, "ferry:request_generation_tokens_bucket", le="5.0") == 3
    assert val(after, "ferry:request_generation_tokens_sum") == 6


def test_second_event_moves_by_its_own_amount_only():
    m = fresh()
    m.on_request_finished(finish_reason="stop", prompt_tokens=4, completion_tokens=2,
                          ttft_s=0.1, e2e_s=0.2, itl_s=[0.1])
    s1 = samples(m)
    m.on_request_finished(finish_reason="length", prompt_tokens=6, completion_tokens=3,
                          ttft_s=0.3, e2e_s=0.5, itl_s=[0.1, 0.1])
    s2 = samples(m)
    assert val(s2, "ferry:prompt_tokens_total") - val(s1, "ferry:prompt_tokens_total") == 6
    assert (val(s2, "ferry:generation_tokens_total")
            - val(s1, "ferry:generation_tokens_total")) == 3
    assert val(s2, "ferry:request_success_total", finished_reason="stop") == 1
    assert val(s2, "ferry:request_success_total", finished_reason="length") == 1
    assert (val(s2, "ferry:inter_token_latency_seconds_count")
            - val(s1, "ferry:inter_token_latency_seconds_count")) == 2


def test_finish_reason_series_exist_at_zero_before_any_request():
    snap = samples(fresh())
    for reason in ("stop", "length", "abort"):
        assert val(snap, "ferry:request_success_total", finished_reason=reason) == 0
    assert val(snap, "ferry:prompt_tokens_total") == 0
    assert val(snap, "ferry:num_requests_running") == 0


def test_engine_stats_set_gauges_from_statsout_and_serverinfo():
    m = fresh()
    m.on_engine_stats(StatsOut(num_running=3, num_waiting=7, kv_usage=0.25,
                               prompt_tokens=999, generation_tokens=999))
    snap = samples(m)
    assert val(snap, "ferry:num_requests_running") == 3
    assert val(snap, "ferry:num_requests_waiting") == 7
    assert val(snap, "ferry:kv_cache_usage_perc") == 0.25
    # StatsOut token fields must not be counted (on_request_finished owns the counters)
    assert val(snap, "ferry:prompt_tokens_total") == 0
    assert val(snap, "ferry:generation_tokens_total") == 0

    m.on_engine_stats(ServerInfoOut(rid="x", kv_used_tokens=300, kv_free_tokens=900,
                                    kv_total_tokens=1200, num_running=1, num_waiting=0))
    snap = samples(m)
    assert val(snap, "ferry:kv_cache_usage_perc") == pytest.approx(300 / 1200)
    assert val(snap, "ferry:num_requests_running") == 1
    assert val(snap, "ferry:num_requests_waiting") == 0


def test_response_store_gauges():
    """Issue 41: the Responses API store's size (responses kept, estimated bytes) is two
    gauges, at 0 before anything is stored, set as ``/metrics`` reads the store."""
    m = fresh()
    snap = samples(m)
    assert val(snap, "ferry:responses_store_items") == 0
    assert val(snap, "ferry:responses_store_bytes") == 0
    m.on_response_store(3, 12345)
    snap = samples(m)
    assert val(snap, "ferry:responses_store_items") == 3
    assert val(snap, "ferry:responses_store_bytes") == 12345
    m.on_response_store(0, 0)
    assert val(samples(m), "ferry:responses_store_bytes") == 0


def test_registries_are_private():
    a, b = fresh(), fresh()  # a global registry would raise "Duplicated timeseries"
    a.on_request_finished(finish_reason="stop", prompt_tokens=5, completion_tokens=1,
                          ttft_s=0.1, e2e_s=0.1)
    assert val(samples(a), "ferry:prompt_tokens_total") == 5
    assert val(samples(b), "ferry:prompt_tokens_total") == 0
    assert b"ferry:" not in generate_latest(REGISTRY)


def test_process_metrics_are_in_the_private_registry():
    m = Metrics(MODEL, include_process_metrics=True)
    names = {name for name, _ in samples(m)}
    assert "python_info" in names
    assert "ferry:num_requests_running" in names


@pytest.mark.parametrize("kw", [
    {"prompt_tokens": -1},
    {"completion_tokens": -2},
    {"e2e_s": -0.1},
    {"ttft_s": math.nan},
    {"itl_s": [0.1, -0.01]},
    {"queue_s": math.inf},
])
def test_invalid_events_raise_and_move_nothing(kw):
    m = fresh()
    base = {"finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1,
            "ttft_s": 0.1, "e2e_s": 0.2, "queue_s": None, "itl_s": []}
    base.update(kw)
    with pytest.raises(ValueError):
        m.on_request_finished(**base)
    snap = samples(m)
    assert val(snap, "ferry:request_success_total", finished_reason="stop") == 0
    assert val(snap, "ferry:prompt_tokens_total") == 0


def test_token_buckets():
    assert token_buckets(1) == (1.0,)
    assert token_buckets(100) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    assert token_buckets(8192)[-3:] == (2000.0, 5000.0, 8192.0)
    with pytest.raises(ValueError):
        token_buckets(0)


def test_format_request_log_fields_and_one_line():
    line = format_request_log("chat-1", 12, 5, 0.08, 0.48, "stop")
    fields = dict(kv.split("=", 1) for kv in line.split(" "))
    assert fields == {
        "rid": "chat-1", "finish_reason": "stop", "prompt_tokens": "12",
        "completion_tokens": "5", "ttft_ms": "80.0", "e2e_ms": "480.0",
        "tpot_ms": "100.0",        # (0.48 - 0.08) / 4 s
        "out_tok_s": "10.4",       # 5 / 0.48 = 10.42
    }
    # undefined figures are '-', and a hostile rid cannot break the line or add fields
    line = format_request_log("a b\nrid=evil", 3, 0, None, 0.0, "abort")
    assert "\n" not in line
    fields = dict(kv.split("=", 1) for kv in line.split(" "))
    assert fields["rid"] == "a_b_rid_evil"
    assert fields["ttft_ms"] == "-" and fields["tpot_ms"] == "-" and fields["out_tok_s"] == "-"


def test_tokenizer_manager_observes_the_engines_queue_time():
    """``ferry:request_queue_time_seconds`` gets one sample per request the engine admitted:
    the ``queue_time_s`` its outputs carry (-1 before admission: no sample). It never got
    one: the server passed ``queue_s=None`` always (issue 34, kind 8)."""
    import asyncio
    import time

    from app_helpers import fake_tm

    from engine import io_struct as io
    from engine.args import ServerArgs
    from server.tokenizer_manager import _ReqState

    tm = fake_tm(ServerArgs())

    def out(rid, queue_s, fin):
        return io.BatchStrOut(rids=[rid], texts=["x"], new_token_ids=[[5]],
                              finished_reasons=[fin], prompt_tokens=[3], completion_tokens=[1],
                              queue_time_s=[queue_s])

    stop = {"type": "stop", "matched": 2, "message": None}
    for rid in ("a", "b"):
        tm.states[rid] = _ReqState(asyncio.Queue(), 0, time.monotonic(), 3)
    tm._dispatch(out("a", 0.25, None))
    tm._dispatch(out("a", 0.25, stop))
    tm._dispatch(out("b", -1.0, stop))  # never admitted (e.g. aborted while waiting)
    snap = samples(tm.metrics)
    assert val(snap, "ferry:request_queue_time_seconds_count", model_name="fake") == 1
    assert val(snap, "ferry:request_queue_time_seconds_sum", model_name="fake") == 0.25
    assert val(snap, "ferry:e2e_request_latency_seconds_count", model_name="fake") == 2
