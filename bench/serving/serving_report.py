"""The report of ``ferry bench-serving``: what one request measured (``RequestOutput``), the
statistics over a run (``metrics``, ``turn_metrics``, ``server_ttft_figures``), the printed
table (``format_table``) and strict-JSON cleaning of the result (``json_safe``). No HTTP: the
client (``bench/serving/serving_client.py``) fills the records, this module only reads them."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """What one request measured. Times in seconds; ``start`` is relative to the run start."""

    prompt_len: int = 0
    output_len: int = 0
    success: bool = False
    error: str = "not sent (max-duration reached)"
    start: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (prefix cache hits)
    text: str = ""          # the streamed completion text

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1) in s; None with fewer than 2 output tokens."""
        if not self.success or self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default "linear" method, Hyndman & Fan type 7). NaN for an empty list.

    Raises:
        ValueError: ``q`` outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """``mean``, ``median``, ``std`` (population), ``p90``, ``p99`` of ``values`` times
    ``scale`` (e.g. 1000 for s -> ms). All NaN for an empty list."""
    xs = [v * scale for v in values]
    if not xs:
        nan = float("nan")
        return {"mean": nan, "median": nan, "std": nan, "p90": nan, "p99": nan}
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return {"mean": mean, "median": percentile(xs, 50), "std": std,
            "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


def metrics(outputs: list[RequestOutput], duration: float) -> dict:
    """Aggregate figures over ``outputs`` for a run of ``duration`` seconds.

    Token counts and latencies use successful requests only; input tokens are the server's
    ``prompt_tokens`` when reported, else the sent prompt length. ITL pools every gap of every
    request. Latencies are in ms, throughputs in req/s and tok/s.
    """
    ok = [o for o in outputs if o.success]
    n_in = sum(o.prompt_tokens or o.prompt_len for o in ok)
    n_out = sum(o.output_tokens for o in ok)
    n_cached = sum(o.cached_tokens for o in ok)
    dur = max(duration, 1e-9)
    errors: dict[str, int] = {}
    for o in outputs:
        if not o.success:
            key = o.error.split(":")[0][:80]
            errors[key] = errors.get(key, 0) + 1
    return {
        "completed": len(ok), "failed": len(outputs) - len(ok), "errors": errors,
        "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "cached_input_tokens": n_cached,
        "request_throughput": len(ok) / dur,
        "input_throughput": n_in / dur, "output_throughput": n_out / dur,
        "total_throughput": (n_in + n_out) / dur,
        "ttft_ms": summarize([o.ttft for o in ok], 1e3),
        "itl_ms": summarize([g for o in ok for g in o.itl], 1e3),
        "tpot_ms": summarize([o.tpot for o in ok if o.tpot is not None], 1e3),
        "e2e_ms": summarize([o.e2e for o in ok], 1e3),
    }


def turn_metrics(outs: list[list[RequestOutput]], turns: int) -> dict:
    """Per-turn figures of a multi-turn run (``outs[c][k]``: conversation c, turn k + 1):
    ``turn_ttft_ms`` (turn number as a string -> median TTFT in ms, successful turns only)
    and ``ttft_later_over_first`` (median TTFT of turns 2.. over that of turn 1, or None)."""
    per_turn: dict[str, float] = {}
    for k in range(turns):
        ttfts = [conv[k].ttft for conv in outs if len(conv) > k and conv[k].success]
        if ttfts:
            per_turn[str(k + 1)] = 1e3 * statistics.median(ttfts)
    later = [conv[k].ttft for conv in outs for k in range(1, len(conv)) if conv[k].success]
    first = [conv[0].ttft for conv in outs if conv and conv[0].success]
    return {"turn_ttft_ms": per_turn,
            "ttft_later_over_first": (statistics.median(later) / statistics.median(first)
                                      if later and first else None)}


def cache_hit_rate(before: dict | None, after: dict | None) -> float | None:
    """The server's prefix-cache hit rate over a run (hits / queries, in tokens)."""
    if before is None or after is None:
        return None
    q = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    return (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / q if q > 0 else None


def server_ttft_figures(ttft_before: tuple[float, float] | None,
                        ttft_after: tuple[float, float] | None,
                        parts_before: dict | None, parts_after: dict | None) -> dict:
    """The server's own mean TTFT over a run, from the change of its ``/metrics`` histogram
    (``(sum, count)`` before and after), and ferry's split of it from ``/server_info``
    (arrival to scheduler, scheduler to first token), in ms: ``server_ttft_ms_mean``,
    ``ttft_queue_ms_mean``, ``ttft_engine_ms_mean``, each None when not measurable."""
    # the server's own TTFT (arrival at the server to the first token leaving the engine's
    # side), so the client's and the network's share of TTFT can be told apart
    out: dict = {"server_ttft_ms_mean": None}
    if ttft_after is not None and ttft_after[1] > ttft_before[1]:
        out["server_ttft_ms_mean"] = (1e3 * (ttft_after[0] - ttft_before[0])
                                      / (ttft_after[1] - ttft_before[1]))
    # ferry only: the server-to-scheduler and scheduler-to-first-token parts of it
    out["ttft_queue_ms_mean"] = out["ttft_engine_ms_mean"] = None
    if parts_after is not None:
        n = parts_after["first_tokens"] - parts_before["first_tokens"]
        if n > 0:
            for key, name in (("ttft_queue_s_sum", "ttft_queue_ms_mean"),
                              ("ttft_engine_s_sum", "ttft_engine_ms_mean")):
                out[name] = 1e3 * (parts_after[key] - parts_before[key]) / n
    return out


# -------------------------------------------------------------------------------- output


def format_table(m: dict) -> str:
    """The human-readable summary of ``metrics`` output."""
    rows = [("Successful requests", f"{m['completed']}"), ("Failed requests", f"{m['failed']}"),
            ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
            ("Total input tokens", f"{m['total_input_tokens']}"),
            ("Total output tokens", f"{m['total_output_tokens']}"),
            ("Cached input tokens (usage)", f"{m.get('cached_input_tokens', 0)}"),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("Input token throughput (tok/s)", f"{m['input_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{m['total_throughput']:.2f}")]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"),
                      ("e2e_ms", "E2E latency")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", f"{m[key][stat]:.2f}"))
    if m.get("server_cache_hit_rate") is not None:
        rows.append(("Prefix cache hit rate (server)", f"{m['server_cache_hit_rate']:.4f}"))
    if m.get("turn_ttft_ms"):
        for turn, v in sorted(m["turn_ttft_ms"].items(), key=lambda kv: int(kv[0])):
            rows.append((f"Median TTFT turn {turn} (ms)", f"{v:.2f}"))
    if m.get("server_ttft_ms_mean") is not None:
        rows.append(("Server-side mean TTFT (ms, /metrics)", f"{m['server_ttft_ms_mean']:.2f}"))
    if m.get("ttft_engine_ms_mean") is not None:
        rows.append(("  arrival -> scheduler (ms, mean)", f"{m['ttft_queue_ms_mean']:.2f}"))
        rows.append(("  scheduler -> first token (ms, mean)", f"{m['ttft_engine_ms_mean']:.2f}"))
    lines = ["{s:=^60}".format(s=" Serving Benchmark Result ")]
    lines += [f"{k:<44}{v:>16}" for k, v in rows]
    for err, n in m["errors"].items():
        lines.append(f"  failed: {n} x {err}")
    lines.append("=" * 60)
    return "\n".join(lines)


def json_safe(obj):
    """NaN/inf -> None, so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
