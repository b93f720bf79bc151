"""The workloads of ``ferry bench-serving``: what to send and when. Plain data, no HTTP (the
client is ``bench/serving/serving_client.py``), so every other serving module can import it.

- ``random``: prompts of random token ids (``random_requests``).
- ``sharegpt``: the first human turn of each conversation of a ShareGPT-style JSON file
  (``sharegpt_requests``).
- ``generated-shared-prefix`` (the shape of SGLang's dataset of that name): G groups of P
  prompts; each group has its own random "system prompt" of S token ids and each prompt adds
  its own Q-token question; O output tokens each. A prefix cache can serve every prompt but
  the first of each group from the cache, so the ideal hit count is ``G * (P - 1) * S``.
- ``multi-turn``: C conversations at once, T turns each. Turn k sends the text of every
  earlier turn (user message and the server's answer) plus a new user message of about U
  tokens (``user_message``), and waits for its answer before turn k + 1, as a chat client
  does (``serving_client.run_multiturn`` replays it). Reported per turn: median TTFT (with a
  prefix cache, turns 2..T should cost about as much as turn 1).

``arrival_offsets`` gives the Poisson send times of the open-loop workloads.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass

_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "da", "ho", "gu", "zi",
              "ba", "fe", "no", "ru", "shi", "to", "wa")


@dataclass
class RequestInput:
    """One request to send: ``prompt`` is a list of token ids or a string; lengths in tokens."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def estimate_tokens(text: str) -> int:
    """Rough token count without a tokenizer: about 4 tokens per 3 words."""
    return max(1, math.ceil(len(text.split()) * 4 / 3))


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
            return estimate_tokens(text)
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


def user_message(rng: random.Random, approx_tokens: int) -> str:
    """One multi-turn user message of about ``approx_tokens`` tokens of made-up words, in
    the ``User: ...\\nAssistant:`` shape."""
    words = []
    while estimate_tokens(" ".join(words)) < approx_tokens:
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
    return "User: " + " ".join(words) + "\nAssistant:"


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
