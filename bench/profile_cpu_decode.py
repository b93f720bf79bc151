"""Where a CPU decode step's time goes: torch.profiler's CPU ops over eager decode steps.

``python -m bench.profile_cpu_decode --batch-size 1 --input-len 128 --steps 16
[--cpu-threads N] [engine args]`` prints the step's median wall time without and with the
profiler, the ops by self CPU time per step (ms) with their calls per step, the sum of the
``ferry_cpu::`` kernels' and the aten ops' self times, and the rest of the step (Python,
dispatch and launch overhead: the wall time minus all ops' self time).
(``bench.profile_decode`` does the same from device time, which the CPU does not have.)
"""

from __future__ import annotations

import statistics

from torch.profiler import ProfilerActivity, profile

from bench.bench_latency import run_once
from bench.profile_decode import warm_runner


def main(argv=None):
    ns, _, runner = warm_runner("profile_cpu_decode", argv, 128, 16)
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
