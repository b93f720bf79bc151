"""``ferry bench-offline``: offline throughput through the engine (no HTTP).

Default workload, as nano-vllm's bench: 256 requests, input and output lengths uniform in
100..1024, random token ids, ``ignore_eos``, a fixed seed. All requests are submitted at once
to the continuous-batching scheduler. Prints requests/s and input, output and total tok/s.
"""

from __future__ import annotations

import argparse
import random
import time

from bench.result_line import emit_result
from engine import device as dev
from engine.args import ServerArgs
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req
from server.cli import add_engine_args


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ferry bench-offline", description=__doc__)
    p.add_argument("--num-prompts", type=int, default=256,
                   help="requests to run (default: 256)")
    p.add_argument("--min-input-len", type=int, default=100,
                   help="shortest random prompt in tokens (default: 100)")
    p.add_argument("--max-input-len", type=int, default=1024,
                   help="longest random prompt in tokens (default: 1024)")
    p.add_argument("--min-output-len", type=int, default=100,
                   help="fewest tokens generated per request (default: 100)")
    p.add_argument("--max-output-len", type=int, default=1024,
                   help="most tokens generated per request (default: 1024)")
    p.add_argument("--bench-seed", type=int, default=0,
                   help="seed of the random prompts and lengths (default: 0)")
    p.add_argument("--result-jsonl", default=None, help="append the result as one JSON line")
    p.add_argument("--warmup", type=int, default=1,
                   help="warm-up requests before timing (default: 1)")
    add_engine_args(p)
    ns = p.parse_args(argv)
    args = ServerArgs.from_cli_args(ns)
    from engine.llm import LLM

    llm = LLM(**{k: v for k, v in vars(args).items()})
    rng = random.Random(ns.bench_seed)
    vocab = llm.vocab_size
    work = []
    for _ in range(ns.num_prompts):
        il = rng.randint(ns.min_input_len, ns.max_input_len)
        ol = rng.randint(ns.min_output_len, ns.max_output_len)
        work.append(([rng.randrange(vocab) for _ in range(il)], ol))
    # warm-up (graphs, Triton compilation) outside the timed region
    for i in range(ns.warmup):
        llm.generate([work[i][0][:64]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    sched = llm.scheduler
    reqs = [Req(f"bench-{i}", ids, SamplingParams(max_tokens=ol, temperature=0, ignore_eos=True),
                max_new_tokens=ol) for i, (ids, ol) in enumerate(work)]
    dev.synchronize(llm.runner.device_type)
    t0 = time.perf_counter()
    for r in reqs:
        sched.add_request(r)
    peak = 0  # the most requests decoding at once: what the KV pools let run together
    while sched.has_work():
        sched.step()
        peak = max(peak, len(sched.running))
    dev.synchronize(llm.runner.device_type)
    dt = time.perf_counter() - t0
    n_in = sum(len(r.origin_input_ids) for r in reqs)
    n_out = sum(len(r.output_ids) for r in reqs)
    res = {"num_prompts": len(reqs), "duration_s": dt, "requests_per_s": len(reqs) / dt,
           "input_tok_s": n_in / dt, "output_tok_s": n_out / dt, "total_tok_s": (n_in + n_out) / dt,
           "input_tokens": n_in, "output_tokens": n_out, "device": llm.runner.device_type,
           "preemptions": sched.stats["preemptions"], "peak_running": peak,
           "kv_tokens": llm.runner.max_total_tokens,
           "swa_kv_tokens": getattr(llm.runner, "swa_total_tokens", 0)}
    emit_result(res, f"{len(reqs)} requests in {dt:.2f} s: {res['requests_per_s']:.2f} req/s, "
                f"input {res['input_tok_s']:.0f} tok/s, output {res['output_tok_s']:.0f} tok/s, "
                f"total {res['total_tok_s']:.0f} tok/s ({n_in} in, {n_out} out, "
                f"{sched.stats['preemptions']} preemptions); at most {peak} running; KV pool "
                f"{res['kv_tokens']} tokens, windowed pool {res['swa_kv_tokens']}", ns.result_jsonl)


if __name__ == "__main__":
    main()
