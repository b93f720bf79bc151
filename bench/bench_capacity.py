"""``python -m bench.bench_capacity``: how many sequences of one length the scheduler keeps
running at once, and the decode rate at that count (issue 42: Gemma-3-27B's windowed KV pool
against one pool for every layer).

``--num-prompts`` requests of ``--input-len`` random token ids (distinct prompts: no prefix
is shared) and ``--output-len`` tokens each (``ignore_eos``) are submitted at once, and the
scheduler runs them as a server would:

1. fill: the scheduler admits them as its own admission allows (``ExtendAdder``: the prompt
   and the expected output in the full-attention pool, a chunk and a window in the windowed
   pool); the phase ends when every request is admitted, or when ``--settle-steps`` steps
   in a row admitted nothing while requests waited (the pools are full). ``peak_running`` is
   the capacity; ``waiting`` says whether it was the pools (requests left waiting) or the
   workload (none left: raise ``--num-prompts``) that bounded it.
2. decode: ``--decode-steps`` steps are timed with every admitted request decoding: the
   median step time and the output tok/s at that batch (tokens of the timed steps over their
   wall time, the device synchronised at both ends).

Then every request is aborted (nothing waits for the rest to finish). ``--output-len`` must
outlast both phases: a prompt prefilled in c chunks gives each running request c tokens, so
about ``peak x c + settle + decode`` steps; a request that finishes early is counted in
``finished_early`` (its room lets a waiting one in, and the figures no longer describe a
steady batch).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.result_line import emit_result
from engine import device as dev
from engine.args import ServerArgs
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req
from server.cli import add_engine_args


def fill(sched, settle_steps: int) -> dict:
    """Step ``sched`` until nothing waits for admission, or ``settle_steps`` steps in a row
    computed no prompt token while requests waited. Returns ``steps``, ``seconds``,
    ``peak_running`` and ``waiting`` (requests still queued, the partly prefilled one
    included)."""
    steps = idle = peak = 0
    t0 = time.perf_counter()
    while sched.has_work() and idle < settle_steps:
        before = sched.stats["prompt_tokens"]
        sched.step()
        steps += 1
        peak = max(peak, len(sched.running))
        if not sched.waiting and sched.chunked is None:
            break
        idle = idle + 1 if sched.stats["prompt_tokens"] == before else 0
    return {"steps": steps, "seconds": time.perf_counter() - t0, "peak_running": peak,
            "waiting": len(sched.waiting) + (sched.chunked is not None)}


def time_decode(sched, device_type: str, steps: int) -> dict:
    """Time ``steps`` scheduler steps (synchronised at both ends). Returns the median step
    (s), output tok/s (running requests summed over the steps, over the wall time), the
    least and most requests running, and the steps that prefilled (admitted) anything."""
    dev.synchronize(device_type)
    times, sizes, admitting = [], [], 0
    t0 = time.perf_counter()
    for _ in range(steps):
        if not sched.has_work():
            break
        before = sched.stats["prompt_tokens"]
        s = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - s)
        sizes.append(len(sched.running))
        admitting += sched.stats["prompt_tokens"] != before
    dev.synchronize(device_type)
    dt = time.perf_counter() - t0
    return {"decode_steps": len(times),
            "median_step_s": statistics.median(times) if times else float("nan"),
            "decode_tok_s": sum(sizes) / dt if times else float("nan"),
            "min_running": min(sizes, default=0), "max_running": max(sizes, default=0),
            "admitting_steps": admitting}


def run_capacity(llm, num_prompts: int, input_len: int, output_len: int, settle_steps: int = 4,
                 decode_steps: int = 32, seed: int = 0, on_filled=None) -> dict:
    """Both phases on ``llm`` (an ``engine.llm.LLM`` with nothing in flight); every request
    is aborted afterwards, so ``llm`` serves on. ``on_filled`` (optional) is called with
    :func:`fill`'s dict between the phases. Returns the result dict of the benchmark (see
    the module doc; ``kv_tokens`` and ``swa_kv_tokens`` are the pools' sizes, ``pool_fit``
    the sequences of ``input_len + output_len`` tokens the full-attention pool holds at
    their full length)."""
    sched = llm.scheduler
    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    reqs = [Req(f"capacity-{i}", [rng.randrange(llm.vocab_size) for _ in range(input_len)],
                sp, max_new_tokens=output_len) for i in range(num_prompts)]
    preempted = sched.stats["preemptions"]
    for r in reqs:
        sched.add_request(r)
    filled = fill(sched, settle_steps)
    if on_filled is not None:
        on_filled(filled)
    early = sum(1 for r in reqs if r.finished)
    decode = time_decode(sched, llm.runner.device_type, decode_steps)
    for r in reqs:
        sched.abort_request(r.rid)
    while sched.has_work():
        sched.step()
    kv = llm.runner.max_total_tokens
    return {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
            "peak_running": filled["peak_running"], "waiting": filled["waiting"],
            "finished_early": early, "fill_steps": filled["steps"],
            "fill_s": filled["seconds"], **decode,
            "preemptions": sched.stats["preemptions"] - preempted,
            "kv_tokens": kv, "swa_kv_tokens": getattr(llm.runner, "swa_total_tokens", 0),
            "swa_full_tokens_ratio": llm.args.swa_full_tokens_ratio,
            "pool_fit": kv // (input_len + output_len), "device": llm.runner.device_type}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.bench_capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests submitted at once (default: 64)")
    p.add_argument("--input-len", type=int, default=8192,
                   help="prompt tokens of each request (default: 8192)")
    p.add_argument("--output-len", type=int, default=256,
                   help="max_tokens of each request (default: 256)")
    p.add_argument("--settle-steps", type=int, default=4,
                   help="steps in a row that admit nothing while requests wait before the "
                        "pools count as full (default: 4)")
    p.add_argument("--decode-steps", type=int, default=32,
                   help="decode steps timed at the peak (default: 32)")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--result-jsonl", default=None, help="append the result as one JSON line")
    add_engine_args(p)
    ns = p.parse_args(argv)
    args = ServerArgs.from_cli_args(ns)
    from engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(**{k: v for k, v in vars(args).items()})
    # warm-up (graphs, Triton compilation) outside the measured phases
    llm.generate([[1] * 64], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    print(f"loaded and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)

    def filled(f: dict) -> None:  # the count, in case the decode phase runs out of time
        print(f"filled in {f['seconds']:.1f} s ({f['steps']} steps): {f['peak_running']} "
              f"running, {f['waiting']} waiting", flush=True)

    res = run_capacity(llm, ns.num_prompts, ns.input_len, ns.output_len, ns.settle_steps,
                       ns.decode_steps, ns.bench_seed, filled)
    bound = "pools" if res["waiting"] else "workload: raise --num-prompts"
    emit_result(res, f"capacity at {ns.input_len}+{ns.output_len} tokens "
                f"(--swa-full-tokens-ratio {res['swa_full_tokens_ratio']:g}): "
                f"{res['peak_running']} running, {res['waiting']} left waiting (bound by the "
                f"{bound}); filled in {res['fill_s']:.1f} s ({res['fill_steps']} steps); decode "
                f"at {res['min_running']}-{res['max_running']} running: median step "
                f"{res['median_step_s'] * 1e3:.2f} ms, {res['decode_tok_s']:.0f} tok/s over "
                f"{res['decode_steps']} steps ({res['admitting_steps']} admitting, "
                f"{res['preemptions']} preemptions, {res['finished_early']} finished early); "
                f"KV pool {res['kv_tokens']} tokens ({res['pool_fit']} sequences at full "
                f"length), windowed pool {res['swa_kv_tokens']}", ns.result_jsonl)
    llm.shutdown()
    return res


if __name__ == "__main__":
    main()
