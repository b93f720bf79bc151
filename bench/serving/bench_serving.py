"""``ferry bench-serving``: an online load generator for a running ferry (or any
OpenAI-compatible) server, in the spirit of SGLang's and vLLM's ``bench_serving``.

Requests arrive as a Poisson process (``--request-rate`` req/s, seeded; ``inf`` sends them all
at once), optionally capped at ``--max-concurrency`` in flight. Prompts are random token ids
(``--random-input-len``/``--random-output-len``, lengths uniform in ``[ratio * len, len]``),
sent as ``prompt: [ids]`` to ``/v1/completions`` with ``ignore_eos`` so the output length is
exact, or come from a ShareGPT-style JSON file (``--dataset-path``). Two prefix-sharing
workloads (``--dataset-name generated-shared-prefix`` and ``multi-turn``, see
``bench/serving/workloads.py``) exercise a prefix cache; the server's hit rate (from its
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
import json
import math

from bench.serving.serving_client import run_benchmark, run_multiturn
from bench.serving.serving_report import format_table, json_safe
from bench.serving.workloads import random_requests, shared_prefix_requests, sharegpt_requests

DEFAULT_URL = "http://127.0.0.1:30000"


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every flag's default."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferry bench-serving", description=__doc__,
                                formatter_class=_Formatter)
    p.add_argument("--base-url", default=DEFAULT_URL)
    p.add_argument("--model", default=None, help="default: the first id from /v1/models; a "
                   "comma-separated list spreads the requests over the names in turn (LoRA "
                   "adapters of one server)")
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
                        "bench/serving/workloads.py for the two prefix-sharing ones")
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
    name = ns.dataset_name or ("sharegpt" if ns.dataset_path else "random")
    if name == "sharegpt":
        if not ns.dataset_path:
            raise SystemExit("--dataset-name sharegpt needs --dataset-path")
        tok = _load_tokenizer(ns.tokenizer) if ns.tokenizer else None
        reqs = sharegpt_requests(ns.dataset_path, ns.num_prompts, ns.seed, tok,
                                 ns.dataset_output_len)
    elif name == "generated-shared-prefix":
        reqs = shared_prefix_requests(
            ns.gsp_num_groups, ns.gsp_prompts_per_group, ns.gsp_system_prompt_len,
            ns.gsp_question_len, ns.gsp_output_len, ns.vocab_low, ns.vocab_high, ns.seed)
    elif name == "random":
        reqs = random_requests(ns.num_prompts, ns.random_input_len, ns.random_output_len,
                               ns.random_range_ratio, ns.vocab_low, ns.vocab_high, ns.seed)
    if name == "multi-turn":
        result = asyncio.run(run_multiturn(
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
            json.dump(json_safe(result), f, indent=1, allow_nan=False)
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ferry bench-serving``; returns the exit code: 1 with
    ``--fail-on-error`` when any request failed, else 0."""
    result = run(argv)
    return 1 if result["config"]["fail_on_error"] and result["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
