"""``ferry bench-serving``: an online load generator for a running ferry (or any
OpenAI-compatible) server, in the spirit of SGLang's and vLLM's ``bench_serving``.

Requests arrive as a Poisson process (``--request-rate`` req/s, seeded; ``inf`` sends them all
at once), optionally capped at ``--max-concurrency`` in flight. Prompts are random token ids
(``--random-input-len``/``--random-output-len``, lengths uniform in ``[ratio * len, len]``),
sent as ``prompt: [ids]`` to ``/v1/completions`` with ``ignore_eos`` so the output length is
exact, or come from a ShareGPT-style JSON file (``--dataset-path``). Two prefix-sharing
workloads (``--dataset-name generated-shared-prefix`` and ``multi-turn``, see
``bench/workloads.py``) exercise a prefix cache; the server's hit rate (from its
``prefix_cache_queries``/``prefix_cache_hits`` counters) is printed next to the figures.

Every request streams. Per request it measures TTFT (time to the first chunk with text), ITL
(gaps between text chunks), TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E latency; output
tokens come from the final usage chunk. It prints request and token throughput and
mean/median/p99 of each latency, and ``--output-json`` saves it all with per-request records.
The run is bounded: ``--timeout`` per request, ``--max-duration`` for the whole run (then it
stops sending, cancels what is in flight and counts both as failed).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

DEFAULT_URL = "http://127.0.0.1:30000"


@dataclass
class RequestInput:
    """One request to send: ``prompt`` is a list of token ids or a string; lengths in tokens."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


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


# ------------------------------------------------------------------------------ workload


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                    vocab_low: int, vocab_high: int, seed: int) -> list[RequestInput]:
    """``num`` prompts of random token ids in ``[vocab_low, vocab_high)``; input and output
    lengths uniform integers in ``[max(1, ratio * len), len]``.

    Raises:
        ValueError: lengths below 1, ratio outside [0, 1], or an empty id range.
    """
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1]")
    if vocab_high <= vocab_low or vocab_low < 0:
        raise ValueError("need 0 <= --vocab-low < --vocab-high")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        il = rng.randint(max(1, int(range_ratio * input_len)), input_len)
        ol = rng.randint(max(1, int(range_ratio * output_len)), output_len)
        ids = [rng.randrange(vocab_low, vocab_high) for _ in range(il)]
        out.append(RequestInput(ids, il, ol))
    return out


def _estimate_tokens(text: str) -> int:
    """Rough token count without a tokenizer: about 4 tokens per 3 words."""
    return max(1, math.ceil(len(text.split()) * 4 / 3))


def sharegpt_requests(path: str, num: int, seed: int, tokenizer=None,
                      fixed_output_len: int | None = None) -> list[RequestInput]:
    """``num`` text prompts from a ShareGPT-style JSON list of
    ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}``:
    the first human turn is the prompt, the reply's length (tokens with ``tokenizer``, else a
    word-count estimate) is the output length unless ``fixed_output_len`` is given. Sampled
    with a seeded shuffle; repeats entries if the file has fewer than ``num``.

    Raises:
        ValueError: no usable conversation in the file.
    """
    with open(path) as f:
        data = json.load(f)

    def count(text: str) -> int:
        if tokenizer is None:
            return _estimate_tokens(text)
        return max(1, len(tokenizer.encode(text, add_special_tokens=False)))

    pairs = []
    for item in data:
        conv = item.get("conversations") or item.get("conversation") or []
        for a, b in itertools.pairwise(conv):
            if a.get("from") == "human" and b.get("from") == "gpt":
                if a.get("value") and b.get("value"):
                    pairs.append((a["value"], b["value"]))
                break
    if not pairs:
        raise ValueError(f"{path}: no human/gpt conversation pairs found")
    random.Random(seed).shuffle(pairs)
    out = []
    for i in range(num):
        prompt, reply = pairs[i % len(pairs)]
        ol = fixed_output_len or count(reply)
        out.append(RequestInput(prompt, count(prompt), ol))
    return out


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of ``n`` requests of a Poisson process with ``rate``
    req/s: the first at 0, then exponential gaps with mean ``1/rate``. ``inf`` -> all 0."""
    if rate <= 0:
        raise ValueError("--request-rate must be positive (or inf)")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


# ------------------------------------------------------------------------------- client


async def send_request(client: httpx.AsyncClient, model: str, req: RequestInput,
                       out: RequestOutput, t0: float, timeout: float,
                       extra_body: dict | None = None) -> RequestOutput:
    """Stream one ``/v1/completions`` request and fill ``out`` (TTFT, ITL, E2E, tokens).

    A chunk counts as a token arrival when it carries non-empty text. Failure (recorded in
    ``out.error``, never raised): non-200 status, an ``error`` event, a stream without
    ``[DONE]``, a transport error, or more than ``timeout`` seconds in total.
    """
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if extra_body:
        body.update(extra_body)
    out.prompt_len, out.output_len = req.prompt_len, req.output_len
    start = time.perf_counter()
    out.start = start - t0
    out.error = "cancelled (max-duration reached)"
    last = start
    chunks = 0
    done = False
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:500]
                    out.error = f"HTTP {resp.status_code}: {text}"
                    return out
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        out.error = f"stream error: {json.dumps(msg['error'])[:500]}"
                        return out
                    now = time.perf_counter()
                    choices = msg.get("choices") or []
                    out.text += "".join(c.get("text") or "" for c in choices)
                    if any(c.get("text") for c in choices):
                        if out.ttft is None:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                        chunks += 1
                    usage = msg.get("usage")
                    if usage:
                        out.output_tokens = int(usage.get("completion_tokens") or 0)
                        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        out.cached_tokens = int(details.get("cached_tokens") or 0)
        out.e2e = time.perf_counter() - start
        if not done:
            out.error = "stream ended without [DONE]"
            return out
        if out.ttft is None:
            out.error = "no output text received"
            return out
        if out.output_tokens == 0:  # server sent no usage: count text chunks
            out.output_tokens = chunks
        out.success, out.error = True, ""
    except TimeoutError:
        out.error = f"timeout after {timeout:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def fetch_model(client: httpx.AsyncClient) -> str:
    """The first model id listed at ``/v1/models``.

    Raises:
        RuntimeError: the server lists no model or answers non-200.
    """
    resp = await client.get("/v1/models")
    if resp.status_code != 200:
        raise RuntimeError(f"/v1/models answered HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError("/v1/models lists no model; pass --model")
    return data[0]["id"]


async def scrape_ttft(client: httpx.AsyncClient) -> tuple[float, float] | None:
    """``(sum, count)`` of the server's time-to-first-token histogram from ``/metrics``
    (any family named ``*time_to_first_token_seconds``: ferry, vLLM and SGLang export one),
    or None when the server has no such metric."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get("/metrics")
        if r.status_code != 200:
            return None
        total = count = 0.0
        found = False
        for fam in text_string_to_metric_families(r.text):
            if not fam.name.endswith("time_to_first_token_seconds"):
                continue
            found = True
            for smp in fam.samples:
                if smp.name.endswith("_sum"):
                    total += smp.value
                elif smp.name.endswith("_count"):
                    count += smp.value
        return (total, count) if found else None
    except (httpx.HTTPError, ValueError):
        return None


async def scrape_counters(client: httpx.AsyncClient, suffixes: tuple[str, ...]
                          ) -> dict[str, float] | None:
    """Totals of the ``/metrics`` counters whose family name ends in each suffix (e.g.
    ``prefix_cache_hits``), or None when the server has no ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get("/metrics")
        if r.status_code != 200:
            return None
        out = dict.fromkeys(suffixes, 0.0)
        for fam in text_string_to_metric_families(r.text):
            for suf in suffixes:
                if fam.name.endswith(suf):
                    out[suf] += sum(x.value for x in fam.samples if x.name.endswith("_total"))
        return out
    except (httpx.HTTPError, ValueError):
        return None


CACHE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits")


def cache_hit_rate(before: dict | None, after: dict | None) -> float | None:
    """The server's prefix-cache hit rate over a run (hits / queries, in tokens)."""
    if before is None or after is None:
        return None
    q = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    return (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / q if q > 0 else None


async def scrape_ttft_parts(client: httpx.AsyncClient) -> dict | None:
    """ferry's ``/server_info`` TTFT parts (``first_tokens``, ``ttft_queue_s_sum``,
    ``ttft_engine_s_sum``), or None from a server without them."""
    try:
        r = await client.get("/server_info")
        stats = r.json().get("stats", {}) if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    keys = ("first_tokens", "ttft_queue_s_sum", "ttft_engine_s_sum")
    return {k: float(stats[k]) for k in keys} if all(k in stats for k in keys) else None


async def run_benchmark(base_url: str, requests: list[RequestInput], *, model: str | None,
                        request_rate: float = math.inf, max_concurrency: int | None = None,
                        timeout: float = 600.0, max_duration: float = 3600.0, seed: int = 0,
                        api_key: str | None = None, extra_body: dict | None = None,
                        transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Send ``requests`` on a Poisson schedule and measure them; returns ``metrics(...)``
    plus ``model`` and ``records`` (one dict per request, in input order).

    After ``max_duration`` seconds no more requests are sent and those in flight are
    cancelled; both count as failed. ``transport`` lets tests swap the HTTP transport.

    Raises:
        RuntimeError: ``model`` is None and ``/v1/models`` gives none.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1,
                          max_keepalive_connections=max_concurrency or 100)
    outputs = [RequestOutput(prompt_len=r.prompt_len, output_len=r.output_len) for r in requests]
    # trust_env=False: talk to base_url directly, never through an HTTP(S)_PROXY from the env
    async with httpx.AsyncClient(base_url=base_url, headers=headers, transport=transport,
                                 timeout=httpx.Timeout(timeout), limits=limits,
                                 trust_env=False) as client:
        if model is None:
            model = await fetch_model(client)
        ttft_before = await scrape_ttft(client)
        parts_before = await scrape_ttft_parts(client)
        cache_before = await scrape_counters(client, CACHE_COUNTERS)
        offsets = arrival_offsets(len(requests), request_rate, seed)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        t0 = time.perf_counter()
        deadline = t0 + max_duration

        async def one(i: int) -> None:
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                await send_request(client, model, requests[i], outputs[i], t0, timeout, extra_body)
                return
            async with sem:
                if time.perf_counter() < deadline:
                    await send_request(client, model, requests[i], outputs[i], t0, timeout,
                                       extra_body)

        tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - t0
        ttft_after = await scrape_ttft(client) if ttft_before is not None else None
        parts_after = await scrape_ttft_parts(client) if parts_before is not None else None
        cache_after = await scrape_counters(client, CACHE_COUNTERS)
    result = metrics(outputs, duration)
    result["server_cache_hit_rate"] = cache_hit_rate(cache_before, cache_after)
    result["model"] = model
    # the server's own TTFT (arrival at the server to the first token leaving the engine's
    # side), so the client's and the network's share of TTFT can be told apart
    result["server_ttft_ms_mean"] = None
    if ttft_after is not None and ttft_after[1] > ttft_before[1]:
        result["server_ttft_ms_mean"] = (1e3 * (ttft_after[0] - ttft_before[0])
                                         / (ttft_after[1] - ttft_before[1]))
    # ferry only: the server-to-scheduler and scheduler-to-first-token parts of it
    result["ttft_queue_ms_mean"] = result["ttft_engine_ms_mean"] = None
    if parts_after is not None:
        n = parts_after["first_tokens"] - parts_before["first_tokens"]
        if n > 0:
            for key, name in (("ttft_queue_s_sum", "ttft_queue_ms_mean"),
                              ("ttft_engine_s_sum", "ttft_engine_ms_mean")):
                result[name] = 1e3 * (parts_after[key] - parts_before[key]) / n
    result["records"] = [dict(asdict(o), tpot=o.tpot) for o in outputs]
    return result


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


# ---------------------------------------------------------------------------------- CLI


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferry bench-serving", description=__doc__,
                                formatter_class=_Formatter)
    p.add_argument("--base-url", default=DEFAULT_URL)
    p.add_argument("--model", default=None, help="default: the first id from /v1/models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="req/s of the Poisson arrivals; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [ratio * len, len]; 1.0 = fixed lengths")
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=30000)
    p.add_argument("--dataset-name", default=None,
                   choices=("random", "sharegpt", "generated-shared-prefix", "multi-turn"),
                   help="workload (default: sharegpt with --dataset-path, else random); see "
                        "bench/workloads.py for the two prefix-sharing ones")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-style JSON instead of random")
    p.add_argument("--dataset-output-len", type=int, default=None,
                   help="fixed output length for dataset prompts")
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir or .gguf file, to count dataset tokens")
    g = p.add_argument_group("generated-shared-prefix (SGLang's flag names; the prompt count "
                             "is groups x prompts per group, --num-prompts does not apply)")
    g.add_argument("--gsp-num-groups", type=int, default=64, help="G: system prompts")
    g.add_argument("--gsp-prompts-per-group", type=int, default=16, help="P: prompts each")
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="S: tokens")
    g.add_argument("--gsp-question-len", type=int, default=128, help="Q: tokens per prompt")
    g.add_argument("--gsp-output-len", type=int, default=256, help="O: output tokens")
    g = p.add_argument_group("multi-turn (--num-prompts, --request-rate and --max-concurrency "
                             "do not apply: each conversation sends one turn at a time)")
    g.add_argument("--mt-conversations", type=int, default=32, help="C: chats at once")
    g.add_argument("--mt-turns", type=int, default=8, help="T: turns per chat")
    g.add_argument("--mt-user-len", type=int, default=128, help="U: tokens per user message")
    g.add_argument("--mt-output-len", type=int, default=128, help="output tokens per turn")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=3600.0, help="seconds for the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--fail-on-error", action="store_true",
                   help="exit non-zero if any request failed")
    described = {"base_url": "server to load", "api_key": "Bearer key, if the server needs one",
                 "num_prompts": "requests to send (random and sharegpt)",
                 "max_concurrency": "most requests in flight (none: no cap)",
                 "random_input_len": "prompt tokens, at most", "random_output_len":
                 "output tokens, at most", "vocab_low": "lowest random token id",
                 "vocab_high": "random token ids stay below it", "seed": "workload seed",
                 "output_json": "write the results and per-request records here"}
    for action in p._actions:  # every flag says what it is and shows its default
        if action.help is None and action.dest in described:
            action.help = described[action.dest]
    return p


def _load_tokenizer(path: str):
    import os

    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                             gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def run(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, run the benchmark, print the table, write ``--output-json``; returns
    the result dict."""
    ns = build_parser().parse_args(argv)
    if ns.num_prompts < 1:
        raise SystemExit("--num-prompts must be >= 1")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    from bench import workloads

    name = ns.dataset_name or ("sharegpt" if ns.dataset_path else "random")
    if name == "sharegpt":
        if not ns.dataset_path:
            raise SystemExit("--dataset-name sharegpt needs --dataset-path")
        tok = _load_tokenizer(ns.tokenizer) if ns.tokenizer else None
        reqs = sharegpt_requests(ns.dataset_path, ns.num_prompts, ns.seed, tok,
                                 ns.dataset_output_len)
    elif name == "generated-shared-prefix":
        reqs = workloads.shared_prefix_requests(
            ns.gsp_num_groups, ns.gsp_prompts_per_group, ns.gsp_system_prompt_len,
            ns.gsp_question_len, ns.gsp_output_len, ns.vocab_low, ns.vocab_high, ns.seed)
    elif name == "random":
        reqs = random_requests(ns.num_prompts, ns.random_input_len, ns.random_output_len,
                               ns.random_range_ratio, ns.vocab_low, ns.vocab_high, ns.seed)
    if name == "multi-turn":
        result = asyncio.run(workloads.run_multiturn(
            ns.base_url, conversations=ns.mt_conversations, turns=ns.mt_turns,
            user_len=ns.mt_user_len, output_len=ns.mt_output_len, model=ns.model,
            timeout=ns.timeout, max_duration=ns.max_duration, seed=ns.seed,
            api_key=ns.api_key))
    else:
        result = asyncio.run(run_benchmark(
            ns.base_url, reqs, model=ns.model, request_rate=ns.request_rate,
            max_concurrency=ns.max_concurrency, timeout=ns.timeout,
            max_duration=ns.max_duration, seed=ns.seed, api_key=ns.api_key))
    cfg = vars(ns).copy()
    cfg["api_key"] = "***" if ns.api_key else None  # never write the key to a results file
    if math.isinf(ns.request_rate):
        cfg["request_rate"] = "inf"
    result["config"] = cfg
    print(format_table(result))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(_json_safe(result), f, indent=1, allow_nan=False)
    return result


def _json_safe(obj):
    """NaN/inf -> None, so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ferry bench-serving``; returns the exit code: 1 with
    ``--fail-on-error`` when any request failed, else 0."""
    result = run(argv)
    return 1 if result["config"]["fail_on_error"] and result["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
