"""Prometheus metrics for ferry (``GET /metrics``) and the one-line request log.

Metric names follow vLLM's v1 names with a ``ferry:`` prefix instead of ``vllm:`` so that
existing vLLM dashboards and alerts work after a prefix swap; every series carries a
``model_name`` label. The metrics live in a private ``CollectorRegistry`` (never the global
one), so several servers or tests in one process do not collide.

How the server wires it (server/app.py, server/tokenizer_manager.py):

* At start-up, once the engine's ``ReadyOut`` is in::

      metrics = Metrics(model_name=served_model_name, max_context_len=ready.max_context_len)

* Route ``GET /metrics`` (server/app.py) first asks the engine for its running/waiting
  counts (``refresh_engine_gauges``: a ``ServerInfoOut``, which lands in
  ``on_engine_stats``; up to 1 s, else the last values stay), so the gauges read the
  current values, not those of the last periodic ``StatsOut`` (sent every second: a
  scrape right after a request finished used to see it still running)::

      body, content_type = metrics.render()
      return Response(body, media_type=content_type)

* ``TokenizerManager``, per request (use ``time.monotonic()`` of the server process only):
    - when the request arrives (before tokenizing): ``t_arrival = now``;
    - on the first ``BatchStrOut`` entry that carries new tokens for the rid:
      ``ttft_s = now - t_arrival``;
    - on every later entry with ``k >= 1`` new tokens: append ``(now - t_last) / k`` to the
      request's ``itl_s`` list ``k`` times, then ``t_last = now``;
    - when ``finished_reasons[i]`` is not None (or an ``ErrorOut`` / client abort ends it)::

          metrics.on_request_finished(
              finish_reason=reason["type"],          # "stop" | "length" | "abort"
              prompt_tokens=out.prompt_tokens[i],
              completion_tokens=out.completion_tokens[i],
              ttft_s=ttft_s,                          # None if no token was produced
              e2e_s=now - t_arrival,
              queue_s=queue_s,    # out.queue_time_s[i] (the engine's Req.queue_time), or
                                  # None while it is -1 (never admitted: no sample)
              itl_s=itl_s)
          logger.info(format_request_log(rid, prompt_tokens, completion_tokens,
                                         ttft_s, e2e_s, reason["type"]))

* Listener task, on each ``StatsOut`` (or ``ServerInfoOut``) from the engine:
  ``metrics.on_engine_stats(msg)`` (sets the running/waiting/KV-usage gauges).

Token counters move in ``on_request_finished`` only; the token fields of ``StatsOut`` are
ignored so nothing is counted twice.

Names (vLLM v1, docs/design/metrics.md and docs/usage/metrics.md of vllm-project/vllm):
``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``,
``prompt_tokens_total``, ``generation_tokens_total``, ``request_success_total{finished_reason}``,
``request_prompt_tokens``, ``request_generation_tokens``, ``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``request_time_per_output_token_seconds``,
``e2e_request_latency_seconds``, ``request_queue_time_seconds``. ferry's own:
``responses_store_items`` and ``responses_store_bytes`` (the Responses API's store,
``server/responses/store.py``; set at every scrape by ``on_response_store``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client import exposition as _exposition
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

PREFIX = "ferry:"

#: Prometheus text format 0.0.4, what every Prometheus version scrapes (prometheus-client
#: >= 0.22 calls 1.0.0 "latest"; the body generate_latest() writes is 0.0.4-compatible)
CONTENT_TYPE = getattr(_exposition, "CONTENT_TYPE_PLAIN_0_0_4", _exposition.CONTENT_TYPE_LATEST)

#: finish reasons pre-created at zero so dashboards see every series from the start
FINISH_REASONS = ("stop", "length", "abort")

# Bucket upper bounds in seconds. Chosen to resolve both a 135M model on the CPU (tens of ms
# per token) and large models on GPUs (ms per token), up to long queued requests.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = E2E_BUCKETS


def token_buckets(max_len: int) -> tuple[float, ...]:
    """Bucket bounds for token-count histograms: 1, 2, 5, 10, 20, 50, ... up to ``max_len``.

    Args:
        max_len: largest count of interest in tokens (the context length), >= 1.
    Returns:
        Increasing bounds (floats); the last one is ``max_len`` itself when it is not
        already a 1-2-5 value.
    Raises:
        ValueError: if ``max_len < 1``.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    out: list[float] = []
    mantissa = (1, 2, 5)
    exp = 0
    while True:
        for m in mantissa:
            v = m * 10 ** exp
            if v > max_len:
                if not out or out[-1] != max_len:
                    out.append(float(max_len))
                return tuple(out)
            out.append(float(v))
        exp += 1


class Metrics:
    """ferry's Prometheus metrics, in a private registry.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        max_context_len: context length in tokens; bounds the token-count histograms.
        include_process_metrics: also export ``process_*`` and ``python_*`` series of this
            process (CPU seconds, RSS, open fds, GC), registered in the private registry.
    """

    def __init__(self, model_name: str, *, max_context_len: int = 32768,
                 include_process_metrics: bool = True):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        reg, lbl = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, lbl, registry=reg)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(PREFIX + name, doc, lbl + (extra or []), registry=reg)

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, lbl, buckets=tuple(buckets), registry=reg)

        self.num_requests_running = gauge("num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Number of requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc",
                                         "KV-cache usage. 1 means 100 percent usage.")
        self.responses_store_items = gauge(
            "responses_store_items", "Responses API responses kept in the HTTP process's "
            "store (--responses-store-size bounds it).")
        self.responses_store_bytes = gauge(
            "responses_store_bytes", "Estimated bytes of the stored Responses API responses "
            "(their JSON size plus 64 per object or array; --responses-store-bytes bounds it).")
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of finished requests: the sum of their "
            "usage.prompt_tokens, prefix-cache hits included, each of n samples counted "
            "(/server_info's stats.prompt_tokens counts the computed ones instead).")
        self.generation_tokens = counter("generation_tokens",
                                         "Generated tokens of finished requests.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (hits / queries is "
                                 "the hit rate).")
        self.request_success = counter("request_success",
                                       "Count of finished requests, by finish reason.",
                                       ["finished_reason"])
        tok_b = token_buckets(max(1, int(max_context_len)))
        self.request_prompt_tokens = hist("request_prompt_tokens",
                                          "Number of prefill tokens per request.", tok_b)
        self.request_generation_tokens = hist("request_generation_tokens",
                                              "Number of generation tokens per request.", tok_b)
        self._latency_histograms(hist)

        m = model_name
        for g in (self.num_requests_running, self.num_requests_waiting,
                  self.kv_cache_usage_perc, self.responses_store_items,
                  self.responses_store_bytes):
            g.labels(m).set(0)
        self.prompt_tokens.labels(m)
        self.generation_tokens.labels(m)
        self.prefix_cache_queries.labels(m)
        self.prefix_cache_hits.labels(m)
        for r in FINISH_REASONS:
            self.request_success.labels(m, r)

        # speculative decoding (--speculative-algorithm): no series until the engine
        # reports its counters
        self.spec = SpecDecodeCollector(model_name)
        reg.register(self.spec)

        if include_process_metrics:
            ProcessCollector(registry=reg)
            PlatformCollector(registry=reg)
            GCCollector(registry=reg)

    def _latency_histograms(self, hist: Callable[..., Histogram]) -> None:
        """TTFT, ITL, TPOT, end-to-end and queue-time histograms (seconds)."""
        self.ttft = hist("time_to_first_token_seconds",
                         "Time to first token (TTFT) in seconds, from arrival at the server.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Inter-token latency (ITL) in seconds, one sample per output token "
                        "after the first.", ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Mean time per output token (TPOT) of each request in seconds: "
                         "(e2e - ttft) / (completion_tokens - 1).", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "End-to-end request latency in seconds.", E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Seconds from the scheduler's receipt of a request to its first "
                          "admission into a batch (grammar compilation and the waiting "
                          "queue).", QUEUE_BUCKETS)

    def on_request_finished(self, *, finish_reason: str, prompt_tokens: int,
                            completion_tokens: int, ttft_s: float | None, e2e_s: float,
                            queue_s: float | None = None,
                            itl_s: Iterable[float] = (),
                            cached_tokens: int | None = None) -> None:
        """Record one finished request (any reason, aborts included).

        Args:
            finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` (other strings become
                their own ``finished_reason`` label value; keep the set small).
            prompt_tokens: prompt length in tokens, >= 0.
            completion_tokens: generated tokens, >= 0.
            ttft_s: time to first token in seconds, or None when no token was produced.
            e2e_s: arrival-to-finish latency in seconds, >= 0.
            queue_s: time waiting in the scheduler queue in seconds, or None if unknown.
            itl_s: inter-token latencies in seconds, one per output token after the first.
            cached_tokens: prompt tokens found in the prefix cache, or None when the request
                was never looked up (cache off, or aborted before admission); counts the
                prompt as queried and these tokens as hits.
        Raises:
            ValueError: on a negative count or duration, or a non-finite duration.
        """
        if prompt_tokens < 0 or completion_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got prompt={prompt_tokens} "
                             f"completion={completion_tokens}")
        itl = [float(x) for x in itl_s]
        for name, v in (("ttft_s", ttft_s), ("e2e_s", e2e_s), ("queue_s", queue_s),
                        *(("itl_s", x) for x in itl)):
            if v is not None and (not math.isfinite(v) or v < 0):
                raise ValueError(f"{name} must be a finite duration >= 0 s, got {v!r}")
        m = self.model_name
        self.request_success.labels(m, str(finish_reason)).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        if cached_tokens is not None:
            self.prefix_cache_queries.labels(m).inc(prompt_tokens)
            self.prefix_cache_hits.labels(m).inc(min(max(cached_tokens, 0), prompt_tokens))
        self.request_prompt_tokens.labels(m).observe(prompt_tokens)
        self.request_generation_tokens.labels(m).observe(completion_tokens)
        self.e2e.labels(m).observe(e2e_s)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
            if completion_tokens > 1:
                self.tpot.labels(m).observe(max(0.0, e2e_s - ttft_s) / (completion_tokens - 1))
        if queue_s is not None:
            self.queue.labels(m).observe(queue_s)
        h = self.itl.labels(m)
        for x in itl:
            h.observe(x)

    def on_engine_stats(self, stats) -> None:
        """Set the scheduler gauges from an engine message.

        Args:
            stats: an ``engine.io_struct.StatsOut`` (``num_running``, ``num_waiting``,
                ``kv_usage`` in 0..1) or a ``ServerInfoOut`` (usage is computed as
                ``kv_used_tokens / kv_total_tokens``). Token fields are ignored.
        """
        m = self.model_name
        self.num_requests_running.labels(m).set(stats.num_running)
        self.num_requests_waiting.labels(m).set(stats.num_waiting)
        usage = getattr(stats, "kv_usage", None)
        if usage is None:
            total = getattr(stats, "kv_total_tokens", 0)
            usage = stats.kv_used_tokens / total if total else 0.0
        self.kv_cache_usage_perc.labels(m).set(min(1.0, max(0.0, float(usage))))
        engine_stats = getattr(stats, "stats", None)
        if engine_stats and "spec_verify_steps" in engine_stats:
            self.spec.update(engine_stats)

    def on_response_store(self, items: int, nbytes: int) -> None:
        """Set the response-store gauges (``ResponseStore.stats()``: responses kept, their
        estimated bytes); ``GET /metrics`` calls it before ``render``."""
        self.responses_store_items.labels(self.model_name).set(items)
        self.responses_store_bytes.labels(self.model_name).set(nbytes)

    def render(self) -> tuple[bytes, str]:
        """Return ``(body, content_type)`` for ``GET /metrics`` (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry), CONTENT_TYPE


class SpecDecodeCollector:
    """Speculative decoding's counters as the engine process last reported them (its
    cumulative totals, in ``ServerInfoOut.stats``, which every ``/metrics`` scrape asks
    for), exported as they are. vLLM's ``spec_decode_*`` names:

    - ``spec_decode_num_drafts_total``: (request, verify step) pairs that had drafts;
    - ``spec_decode_num_draft_tokens_total``: draft tokens proposed;
    - ``spec_decode_num_accepted_tokens_total``: draft tokens the target accepted;
    - ``spec_decode_num_emitted_tokens_total``: tokens those steps emitted (accepted drafts
      plus the target's own token per request and step);
    - ``spec_decode_accept_length``: a histogram of tokens emitted per request and verify
      step (1 = every draft rejected; k + 1 = all k accepted);
    - ferry's step costs, gauges once measured: ``spec_decode_verify_step_seconds`` (a
      speculative step: the drafts, EAGLE's or MTP's draft forwards included, and the
      verify forward), ``spec_decode_decode_step_seconds`` (a plain decode step of a
      speculating batch), both running averages, and ``spec_decode_step_cost_ratio``, their
      quotient: a speculative step's cost in plain decode steps (the accept length it must
      beat).
    """

    _COUNTERS = (("num_drafts", "spec_verify_reqs", "Requests' verify steps with drafts."),
                 ("num_draft_tokens", "spec_proposed_tokens", "Draft tokens proposed."),
                 ("num_accepted_tokens", "spec_accepted_tokens",
                  "Draft tokens accepted by the target model."),
                 ("num_emitted_tokens", "spec_emitted_tokens",
                  "Tokens emitted by verify steps: accepted drafts plus one target token "
                  "per request and step."))

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: dict | None = None

    def update(self, stats: dict) -> None:
        self.stats = dict(stats)

    def collect(self):
        st, m = self.stats, [self.model_name]
        if st is None:
            return
        for name, key, doc in self._COUNTERS:
            c = CounterMetricFamily(PREFIX + "spec_decode_" + name, doc, labels=["model_name"])
            c.add_metric(m, float(st.get(key, 0)))
            yield c
        lengths = list(st.get("spec_accept_lengths", []))
        buckets, acc = [], 0
        for i, n in enumerate(lengths):
            acc += n
            buckets.append((str(float(i + 1)), acc))
        buckets.append(("+Inf", acc))
        h = HistogramMetricFamily(PREFIX + "spec_decode_accept_length",
                                  "Tokens emitted per request and verify step.",
                                  labels=["model_name"])
        h.add_metric(m, buckets, sum_value=float(sum((i + 1) * n for i, n in enumerate(lengths))))
        yield h
        yield from self._step_costs(st, m)

    @staticmethod
    def _step_costs(st: dict, m: list[str]):
        v, d = st.get("spec_verify_step_seconds"), st.get("spec_decode_step_seconds")
        for name, value, doc in (
                ("verify_step_seconds", v, "Seconds per speculative step (drafts and "
                                           "verify), a running average."),
                ("decode_step_seconds", d, "Seconds per plain decode step of a speculating "
                                           "batch, a running average."),
                ("step_cost_ratio", v / d if v and d else None,
                 "A speculative step's cost in plain decode steps.")):
            if value is not None:
                g = GaugeMetricFamily(PREFIX + "spec_decode_" + name, doc, labels=["model_name"])
                g.add_metric(m, float(value))
                yield g


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000.0:.1f}"


def format_request_log(rid: str, prompt_tokens: int, completion_tokens: int,
                       ttft_s: float | None, e2e_s: float, finish_reason: str) -> str:
    """One logfmt line per finished request; never contains prompt or output text.

    Example: ``rid=chatcmpl-1 finish_reason=stop prompt_tokens=12 completion_tokens=34
    ttft_ms=81.0 e2e_ms=950.2 tpot_ms=26.3 out_tok_s=35.8`` (one line). TPOT is
    ``(e2e - ttft) / (completion_tokens - 1)`` and out_tok_s is ``completion_tokens / e2e``;
    either is ``-`` when undefined.

    Args:
        rid: request id (whitespace, quotes and newlines are replaced so it stays one field).
        prompt_tokens, completion_tokens: token counts.
        ttft_s: time to first token in seconds, or None.
        e2e_s: end-to-end latency in seconds.
        finish_reason: ``stop`` | ``length`` | ``abort``.
    """
    safe_rid = "".join("_" if (c.isspace() or c in "\"'=") else c for c in str(rid)) or "-"
    tpot = None
    if ttft_s is not None and completion_tokens > 1:
        tpot = max(0.0, e2e_s - ttft_s) / (completion_tokens - 1)
    tps = f"{completion_tokens / e2e_s:.1f}" if e2e_s > 0 else "-"
    reason = "".join("_" if c.isspace() else c for c in str(finish_reason)) or "-"
    return (f"rid={safe_rid} finish_reason={reason} prompt_tokens={prompt_tokens} "
            f"completion_tokens={completion_tokens} ttft_ms={_fmt_ms(ttft_s)} "
            f"e2e_ms={_fmt_ms(e2e_s)} tpot_ms={_fmt_ms(tpot)} out_tok_s={tps}")
