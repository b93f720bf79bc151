"""The HTTP client of ``ferry bench-serving``: streams ``/v1/completions`` requests and times
them (``send_request``), reads the server's own counters (``/metrics``, ``/server_info``),
and runs the two kinds of load: an open-loop Poisson schedule of prepared requests
(``run_benchmark``) and closed-loop multi-turn chats (``run_multiturn``). The requests come
from ``bench/serving/workloads.py``; the figures are computed by ``bench/serving/serving_report.py``."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict

import httpx

from bench.serving.serving_report import (
    RequestOutput,
    cache_hit_rate,
    metrics,
    server_ttft_figures,
    turn_metrics,
)
from bench.serving.workloads import RequestInput, arrival_offsets, estimate_tokens, user_message

CACHE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits")


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
    plus ``model`` and ``records`` (one dict per request, in input order). A ``model`` of
    comma-separated names sends request i to name ``i % count`` (LoRA adapters).

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
        models = model.split(",")
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
            name = models[i % len(models)]
            if sem is None:
                await send_request(client, name, requests[i], outputs[i], t0, timeout, extra_body)
                return
            async with sem:
                if time.perf_counter() < deadline:
                    await send_request(client, name, requests[i], outputs[i], t0, timeout,
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
    result.update(server_ttft_figures(ttft_before, ttft_after, parts_before, parts_after))
    result["records"] = [dict(asdict(o), tpot=o.tpot) for o in outputs]
    return result


async def run_multiturn(base_url: str, *, conversations: int, turns: int, user_len: int,
                        output_len: int, model: str | None = None, timeout: float = 600.0,
                        max_duration: float = 3600.0, seed: int = 0,
                        api_key: str | None = None) -> dict:
    """Replay ``conversations`` chats of ``turns`` turns at once; returns ``metrics(...)``
    over every turn, plus ``turn_ttft_ms`` (turn number -> median TTFT in ms),
    ``server_cache_hit_rate`` and ``records`` (with ``conversation`` and ``turn``). No turn
    starts after ``max_duration`` seconds (the chats are cut short there)."""
    if min(conversations, turns, user_len, output_len) < 1:
        raise ValueError("every --mt-* count and length must be >= 1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=conversations)
    outs: list[list[RequestOutput]] = [[] for _ in range(conversations)]
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout), trust_env=False) as client:
        if model is None:
            model = await fetch_model(client)
        before = await scrape_counters(client, CACHE_COUNTERS)
        t0 = time.perf_counter()

        async def chat(c: int) -> None:
            rng = random.Random(seed * 100_003 + c)
            history = ""
            for _ in range(turns):
                if time.perf_counter() - t0 > max_duration:
                    return
                prompt = history + user_message(rng, user_len)
                req = RequestInput(prompt, estimate_tokens(prompt), output_len)
                out = RequestOutput()
                outs[c].append(out)
                await send_request(client, model, req, out, t0, timeout)
                if not out.success:
                    return  # the conversation cannot go on without the answer
                history = prompt + out.text + "\n"

        await asyncio.gather(*(chat(c) for c in range(conversations)))
        duration = time.perf_counter() - t0
        after = await scrape_counters(client, CACHE_COUNTERS)
    flat = [o for conv in outs for o in conv]
    result = metrics(flat, duration)
    result["model"] = model
    result["server_cache_hit_rate"] = cache_hit_rate(before, after)
    result.update(turn_metrics(outs, turns))
    result["records"] = [dict(conversation=c, turn=k + 1, ttft=o.ttft, e2e=o.e2e,
                              success=o.success, error=o.error, prompt_tokens=o.prompt_tokens,
                              cached_tokens=o.cached_tokens, output_tokens=o.output_tokens)
                         for c, conv in enumerate(outs) for k, o in enumerate(conv)]
    return result
