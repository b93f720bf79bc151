"""Where a decode step's device time goes: torch.profiler over eager decode steps.

``python -m bench.profile_decode --model-path engine/configs/llama-3-8b.json --load-format
dummy --batch-size 1 --input-len 512`` prints the kernels by total device time with their
launch counts per step, and the step's sum of kernel time.
"""

from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from bench.bench_latency import run_once
from engine import device as dev
from engine.args import ServerArgs


def warm_runner(prog: str, argv, input_len: int, steps: int):
    """Parse ``--batch-size --input-len --steps`` and the engine's flags, build a model runner
    sized for one such batch and warm it up (compiles, allocator); ``(ns, args, runner)``."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--steps", type=int, default=steps)
    ServerArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    args = ServerArgs.from_cli_args(ns).replace(
        max_total_tokens=ns.batch_size * (ns.input_len + ns.steps + 16),
        max_running_requests=ns.batch_size)
    from engine.executor.model_runner import ModelRunner

    runner = ModelRunner(args)
    run_once(runner, ns.batch_size, ns.input_len, 4)  # warm-up and compile
    return ns, args, runner


def main(argv=None):
    ns, args, runner = warm_runner("profile_decode", argv, 512, 8)
    acts = [ProfilerActivity.CPU]
    if dev.is_accelerator(runner.device_type):
        acts.append(ProfilerActivity.CUDA if runner.device_type == "cuda" else ProfilerActivity.XPU)
    prof = profile(activities=acts)
    res = run_once(runner, ns.batch_size, ns.input_len, ns.steps + 1, decode_context=prof)
    dev.synchronize(runner.device_type)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    steps = ns.steps  # decode steps only (the prefill is outside the profiled region)
    total = sum(e.self_device_time_total for e in events)
    wall = sorted(res["decode_steps_s"])[len(res["decode_steps_s"]) // 2] * 1e3
    print(f"graphs={'on' if runner.graph_runner else 'off'} fused_ops={not args.disable_fused_ops}"
          f" bs={ns.batch_size} in={ns.input_len}: kernel time {total / 1e3 / steps:.3f} ms per"
          f" decode step; step wall time (events) {wall:.3f} ms median under the profiler")
    print(f"{'kernel':70s} {'ms/step':>8s} {'calls/step':>10s}")
    for e in events[:25]:
        if e.self_device_time_total <= 0:
            continue
        print(f"{e.key[:70]:70s} {e.self_device_time_total / 1e3 / steps:8.3f} "
              f"{e.count / steps:10.1f}")


if __name__ == "__main__":
    main()
