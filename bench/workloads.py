"""Prefix-sharing workloads for ``ferry bench-serving``.

- ``generated-shared-prefix`` (the shape of SGLang's dataset of that name): G groups of P
  prompts; each group has its own random "system prompt" of S token ids and each prompt adds
  its own Q-token question; O output tokens each. A prefix cache can serve every prompt but
  the first of each group from the cache, so the ideal hit count is ``G * (P - 1) * S``.
- ``multi-turn``: C conversations at once, T turns each. Turn k sends the text of every
  earlier turn (user message and the server's answer) plus a new user message of about U
  tokens, and waits for its answer before turn k + 1, as a chat client does. Reported per
  turn: median TTFT (with a prefix cache, turns 2..T should cost about as much as turn 1).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx

from bench.bench_serving import (
    CACHE_COUNTERS,
    RequestInput,
    RequestOutput,
    _estimate_tokens,
    cache_hit_rate,
    fetch_model,
    metrics,
    scrape_counters,
    send_request,
)

_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "da", "ho", "gu", "zi",
              "ba", "fe", "no", "ru", "shi", "to", "wa")


def shared_prefix_requests(groups: int, per_group: int, system_len: int, question_len: int,
                           output_len: int, vocab_low: int, vocab_high: int, seed: int
                           ) -> list[RequestInput]:
    """``groups * per_group`` token-id prompts, group by group (all sent at once, the order
    only decides which prompt of a group reaches the server first).

    Raises:
        ValueError: a count or length below 1, or an empty id range.
    """
    if min(groups, per_group, system_len, question_len, output_len) < 1:
        raise ValueError("every --gsp-* count and length must be >= 1")
    if vocab_high <= vocab_low or vocab_low < 0:
        raise ValueError("need 0 <= --vocab-low < --vocab-high")
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        system = [rng.randrange(vocab_low, vocab_high) for _ in range(system_len)]
        for _ in range(per_group):
            q = [rng.randrange(vocab_low, vocab_high) for _ in range(question_len)]
            out.append(RequestInput(system + q, system_len + question_len, output_len))
    return out


def _user_message(rng: random.Random, approx_tokens: int) -> str:
    words = []
    while _estimate_tokens(" ".join(words)) < approx_tokens:
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
    return "User: " + " ".join(words) + "\nAssistant:"


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
                prompt = history + _user_message(rng, user_len)
                req = RequestInput(prompt, _estimate_tokens(prompt), output_len)
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
    per_turn: dict[str, float] = {}
    for k in range(turns):
        ttfts = [conv[k].ttft for conv in outs if len(conv) > k and conv[k].success]
        if ttfts:
            per_turn[str(k + 1)] = 1e3 * statistics.median(ttfts)
    result["turn_ttft_ms"] = per_turn
    later = [conv[k].ttft for conv in outs for k in range(1, len(conv)) if conv[k].success]
    first = [conv[0].ttft for conv in outs if conv and conv[0].success]
    result["ttft_later_over_first"] = (statistics.median(later) / statistics.median(first)
                                       if later and first else None)
    result["records"] = [dict(conversation=c, turn=k + 1, ttft=o.ttft, e2e=o.e2e,
                              success=o.success, error=o.error, prompt_tokens=o.prompt_tokens,
                              cached_tokens=o.cached_tokens, output_tokens=o.output_tokens)
                         for c, conv in enumerate(outs) for k, o in enumerate(conv)]
    return result
