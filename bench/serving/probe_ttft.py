"""Engine-side TTFT probe (no HTTP): with N requests decoding, add one new request and time
every scheduler step until its first token is processed.

``python -m bench.serving.probe_ttft --model-path engine/configs/llama-3-8b.json --load-format dummy
--running 36 --prompt-len 560`` prints per-step wall times (host clock, device synchronised
at the end of each step) and the new request's engine TTFT. Also times the host part of
launching the mixed extend step (no sync) to show whether the step is host-bound.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from engine import device as dev
from engine.args import ServerArgs
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req


def main(argv=None):
    p = argparse.ArgumentParser(prog="probe_ttft")
    p.add_argument("--running", type=int, default=36)
    p.add_argument("--prompt-len", type=int, default=560)
    p.add_argument("--context", type=int, default=600, help="tokens of each running request")
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    from engine.llm import LLM

    llm = LLM(**vars(ServerArgs.from_cli_args(ns)))
    sched, runner = llm.scheduler, llm.runner
    rng = random.Random(0)
    vocab = runner.vocab_size
    sp = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    for i in range(ns.running):
        sched.add_request(Req(f"bg{i}", [rng.randrange(vocab) for _ in range(ns.context)], sp))
    while len(sched.running) < ns.running or sched.waiting or sched.chunked:
        sched.step()
    for _ in range(20):  # steady decode
        sched.step()
    dev.synchronize(runner.device_type)
    for trial in range(3):
        new = Req(f"new{trial}", [rng.randrange(vocab) for _ in range(ns.prompt_len)],
                  SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        t0 = time.perf_counter()
        sched.add_request(new)
        steps = []
        while not new.output_ids or new.output_ids[0] < 0:
            s0 = time.perf_counter()
            sched.step()
            steps.append((time.perf_counter() - s0) * 1e3)
        ttft = (time.perf_counter() - t0) * 1e3
        dev.synchronize(runner.device_type)
        print(f"trial {trial}: engine TTFT {ttft:.1f} ms over {len(steps)} steps: "
              + ", ".join(f"{x:.1f}" for x in steps))
        for _ in range(10):
            sched.step()
    # host time to launch one mixed extend step, without waiting for the device
    new = Req("host", [rng.randrange(vocab) for _ in range(ns.prompt_len)], sp)
    sched.add_request(new)
    sched._drain()  # no placeholders in flight: this batch runs without future ids
    batch = sched.get_next_batch()
    dev.synchronize(runner.device_type)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    logits = runner.forward(batch, None)
    prof.disable()
    t1 = time.perf_counter()
    dev.synchronize(runner.device_type)
    t2 = time.perf_counter()
    print(f"mixed extend step ({batch.batch_size} reqs, {batch.num_tokens} tokens): host launch "
          f"{(t1 - t0) * 1e3:.1f} ms, until done {(t2 - t0) * 1e3:.1f} ms; logits {tuple(logits.shape)}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    # the same step's device time alone: capture it in a graph (no host launches) and replay
    gcls = dev.graph_class(runner.device_type)
    if gcls is not None:
        import torch

        with torch.inference_mode():
            input_ids, fb = runner.build_forward_batch(batch, None)
            runner.attn_backend.init_forward(fb)
            runner.model(input_ids, fb.positions, fb)
            dev.synchronize(runner.device_type)
            g = gcls()
            with dev.graph_context(runner.device_type, g):
                runner.model(input_ids, fb.positions, fb)
            g.replay()
            times = []
            ev = dev.event_class(runner.device_type)
            for _ in range(5):
                a, b = ev(enable_timing=True), ev(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            print(f"same step replayed from a graph: median {sorted(times)[2]:.2f} ms "
                  f"(device time without host launches)")
    # where that device time goes: kernels of the same step, run eagerly under the profiler
    if dev.is_accelerator(runner.device_type):
        from torch.profiler import ProfilerActivity, profile

        act = ProfilerActivity.CUDA if runner.device_type == "cuda" else ProfilerActivity.XPU
        runner.forward(batch, None)
        dev.synchronize(runner.device_type)
        with profile(activities=[ProfilerActivity.CPU, act]) as prof:
            runner.forward(batch, None)
            dev.synchronize(runner.device_type)
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        events.sort(key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in events) / 1e3
        print(f"kernels of the mixed step: {total:.2f} ms in all")
        for e in events[:18]:
            print(f"  {e.key[:80]:80s} {e.self_device_time_total / 1e3:7.3f} ms {e.count:5d} calls")


if __name__ == "__main__":
    main()
