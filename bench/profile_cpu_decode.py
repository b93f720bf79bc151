"""Where a CPU decode step's time goes: torch.profiler's CPU ops over eager decode steps.

``python -m bench.profile_cpu_decode --batch-size 1 --input-len 128 --steps 16
[--cpu-threads N] [engine args]`` prints the step's median wall time without and with the
profiler, the ops by self CPU time per step (ms) with their calls per step, the sum of the
``ferry_cpu::`` kernels' and the aten ops' self times, and the rest of the step (Python,
dispatch and launch overhead: the wall time minus all ops' self time).
(``bench.profile_decode`` does the same from device time, which the CPU does not have.)
"""

from __future__ import annotations

import argparse
import statistics

from torch.profiler import ProfilerActivity, profile

from bench.bench_latency import run_once
from engine.args import ServerArgs


def main(argv=None):
    p = argparse.ArgumentParser(prog="profile_cpu_decode")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    args = ServerArgs.from_cli_args(ns).replace(
        max_total_tokens=ns.batch_size * (ns.input_len + ns.steps + 16),
        max_running_requests=ns.batch_size)
    from engine.executor.model_runner import ModelRunner

    runner = ModelRunner(args)
    run_once(runner, ns.batch_size, ns.input_len, 4)  # warm-up
    plain = run_once(runner, ns.batch_size, ns.input_len, ns.steps + 1)["decode_steps_s"]
    prof = profile(activities=[ProfilerActivity.CPU])
    res = run_once(runner, ns.batch_size, ns.input_len, ns.steps + 1, decode_context=prof)
    steps = ns.steps
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    own = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    ferry = sum(e.self_cpu_time_total for e in events if e.key.startswith("ferry_cpu::"))
    ferry = ferry / 1e3 / steps
    wall_prof = sum(res["decode_steps_s"]) * 1e3 / steps
    print(f"bs={ns.batch_size} in={ns.input_len}: step median {1e3 * statistics.median(plain):.2f}"
          f" ms without the profiler, {wall_prof:.2f} ms mean with it")
    print(f"ops' self time {own:.2f} ms/step: ferry_cpu kernels {ferry:.2f}, other ops "
          f"{own - ferry:.2f}; outside any op (Python, dispatch) {wall_prof - own:.2f} ms/step")
    print(f"{'op':60s} {'ms/step':>8s} {'calls/step':>10s}")
    for e in events[:25]:
        print(f"{e.key[:60]:60s} {e.self_cpu_time_total / 1e3 / steps:8.3f} "
              f"{e.count / steps:10.1f}")


if __name__ == "__main__":
    main()
