"""All-reduce latency and bandwidth between the ranks of one node, through the same
``engine.distributed`` collectives that the model uses: eager, and 64 all-reduces captured in
one device graph (as in a decode step of a 32-layer model), per message size.

    python -m bench.tp_probe --tp-size 2 --sizes-kb 8,64,1024,16384

Prints one line per size: median microseconds per all-reduce (eager, graph) and the bus
bandwidth ``2 (n-1)/n * bytes / time`` (NCCL's convention).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _rank(rank: int, args, addr: str, q) -> None:
    from engine import device as dev
    from engine import distributed as tpd

    device_type = dev.resolve_device("auto")
    dev.set_device(device_type, rank)
    tpd.init_tp(args.tp_size, rank, addr, device_type)
    rows = []
    for kb in args.sizes_kb:
        n = kb * 1024 // 2
        x = torch.ones(n, dtype=torch.bfloat16, device=device_type)
        for _ in range(5):
            tpd.all_reduce(x)
        dev.synchronize(device_type)
        ev = dev.event_class(device_type)
        eager = []
        for _ in range(args.iters):
            if ev is None:  # the CPU: wall time
                t0 = time.perf_counter()
                tpd.all_reduce(x)
                eager.append((time.perf_counter() - t0) * 1e6)
                continue
            a, b = ev(enable_timing=True), ev(enable_timing=True)
            a.record()
            tpd.all_reduce(x)
            b.record()
            b.synchronize()
            eager.append(a.elapsed_time(b) * 1e3)
        graph_us = float("nan")
        g_cls = dev.graph_class(device_type)
        if g_cls is not None and dev.graphs_capture_collectives(device_type):
            g = g_cls()
            with dev.graph_context(device_type, g):
                for _ in range(64):
                    tpd.all_reduce(x)
            g.replay()
            dev.synchronize(device_type)
            times = []
            for _ in range(args.iters):
                a, b = ev(enable_timing=True), ev(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / 64)
            graph_us = statistics.median(times)
        rows.append((kb, statistics.median(eager), graph_us))
    if rank == 0:
        q.put(rows)
    tpd.destroy_tp()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tp_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-size", type=int, default=2, help="ranks (one device each)")
    p.add_argument("--sizes-kb", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8, 64, 1024, 16384], help="message sizes in KiB (bf16)")
    p.add_argument("--iters", type=int, default=50, help="timed all-reduces per size")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    from engine.distributed import free_local_addr

    addr = free_local_addr()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, addr, q)) for r in range(args.tp_size)]
    for pr in procs:
        pr.start()
    rows = q.get(timeout=600)
    for pr in procs:
        pr.join(60)
    n = args.tp_size
    print(f"all-reduce over {n} ranks (bf16): size | eager us | in-graph us | bus GB/s (graph)")
    for kb, e, g in rows:
        bw = 2 * (n - 1) / n * kb * 1024 / (g * 1e-6) / 1e9 if g == g else float("nan")
        print(f"{kb:8d} KiB | {e:9.1f} | {g:9.1f} | {bw:7.1f}")
    return 0


if __name__ == "__main__":
    main()
