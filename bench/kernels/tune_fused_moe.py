"""Tune the fused-MoE launch configurations on this GPU and write the device's table.

``python -m bench.kernels.tune_fused_moe`` sweeps launch configurations of
:func:`kernels.moe.fused_moe.fused_moe` (one configuration drives the alignment and both grouped
GEMMs of a call) for each model shape and batch size M, and writes the fastest per M into
``kernels/moe/moe_configs/<device name>.json`` (``$FERRY_MOE_CONFIG_DIR`` or ``--out`` elsewhere),
the table :func:`kernels.moe.moe_config.get_moe_config` reads. Each figure is the median device
time of ``--iters`` calls (device events around each call, after ``--warmup`` calls; the L2
is flushed before each call so the weights come from memory, as they do in a model's layer
sequence; the call is captured in a CUDA/XPU graph and the graph replayed, so Python's
launch overhead is not counted and every chosen configuration is known to be capturable). The routing is softmax top-k of random logits (renormalised), so the experts are
loaded about evenly. The chosen configuration's output is checked against the torch path
(``kernels.moe.reference.fused_moe_torch``) and a ``MISMATCH`` line is printed if it disagrees.

Shapes (``--model``, repeatable; or ``--shape E,top_k,H,I``): ``qwen3-30b-a3b`` (E=128,
top-8, H=2048, I=768) and ``mixtral-8x7b`` (E=8, top-2, H=4096, I=14336); ``--tp N`` divides
I as tensor parallelism does. Default M: 1, 2, 4, ..., 4096.

The table is written after every M, and (shape, M) pairs already in the file are skipped
unless ``--overwrite``: a run cut short (``--max-minutes``, a time limit) resumes where it
stopped. Compilation dominates a first run (each (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
compiles twice: with and without the routed-weight multiply); ``--space quick`` (default)
tries ~30-120 configurations per M, ``--space full`` ~4x more.

``--compare-align`` also times the two alignments (Triton counting sort vs torch ops) per M.
``--dry-run`` runs a tiny shape with two configurations and one timed call: on the CPU it
runs in the Triton interpreter (to test the script), on a GPU in seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from engine import device as devlib
from kernels.moe import moe_config

MODELS = {  # name: (E, top_k, H, I)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
DRY_SHAPE = (4, 2, 32, 32)
DRY_BATCH_SIZES = [1, 5]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _shape(s: str) -> tuple[int, int, int, int]:
    v = _ints(s)
    if len(v) != 4:
        raise argparse.ArgumentTypeError("--shape wants E,top_k,H,I")
    return tuple(v)


def search_space(space: str, m: int, top_k: int, num_experts: int, dtype: torch.dtype,
                 device_type: str, smem_kib: int) -> list[dict]:
    """Candidate configurations for one M. BLOCK_SIZE_M is capped near the average rows per
    expert (a bigger block only multiplies padding), and a configuration whose pipeline
    buffers ``stages * (BM + BN) * BK * itemsize`` exceed ``smem_kib`` is left out."""
    rows = max(1.0, m * top_k / num_experts)
    # one size above the rows per expert: at ~16 rows an expert often needs two 16-row
    # blocks (each reads the expert's weights), a 32-row block reads them once
    cap_m = max(16, 1 << math.ceil(math.log2(2 * rows)))
    if space == "full":
        cap_m *= 2
        bn, bk, groups = (32, 64, 128, 256), (64, 128, 256), (1, 16, 32)
        warps, stages = (4, 8), (2, 3, 4, 5)
    else:
        bn, bk, groups = (64, 128), (64, 128), (1, 16)
        warps, stages = (4, 8), (3, 4)
    if dtype == torch.float32:
        bk = tuple(sorted({max(32, k // 2) for k in bk}))
    if device_type == "xpu":
        warps, stages = (8, 16, 32), (2, 3)
    bms = [b for b in (16, 32, 64, 128) if b <= min(cap_m, 128)]
    combos = list(itertools.product(bms, bn, bk, groups, warps, stages))
    if space == "quick":
        # decode blocks are weight streams: also try narrower N and deeper K tiles there
        combos += itertools.product([16], (32,), (64, 128, 256), (1,), (4,), stages)
        combos += itertools.product([16], (64, 128), (256,), (1,), (4,), stages)
    out = []
    for bm_, bn_, bk_, g, w, s in combos:
        if s * (bm_ + bn_) * bk_ * dtype.itemsize > smem_kib * 1024:
            continue
        if bm_ * bn_ < 64 * 64 and w > 4 and device_type != "xpu":
            continue                      # 8 warps on a small tile: idle threads
        if rows <= 8 and g > 1:
            continue                      # about one block per expert: nothing to group
        out.append(dict(BLOCK_SIZE_M=bm_, BLOCK_SIZE_N=bn_, BLOCK_SIZE_K=bk_, GROUP_SIZE_M=g,
                        num_warps=w, num_stages=s))
    return out


class Timer:
    """Median time of a callable: device events after warm-up (perf_counter on the CPU).

    On a device with graphs the callable is captured once and the graph is replayed, so the
    figure is device time without Python's launch overhead (as a decode step's graph runs
    it); ``graphs=False`` times eager calls.
    """

    def __init__(self, device_type: str, warmup: int, iters: int, flush_mib: int,
                 graphs: bool = True):
        self.dev, self.warmup, self.iters = device_type, warmup, iters
        accel = devlib.is_accelerator(device_type)
        self.events = devlib.event_class(device_type) if accel else None
        self.graph_cls = devlib.graph_class(device_type) if accel and graphs else None
        self.flush = torch.empty(flush_mib << 20, dtype=torch.uint8, device=device_type) \
            if accel and flush_mib else None

    def __call__(self, fn) -> float:
        """Median microseconds of one call of ``fn``."""
        for _ in range(self.warmup):
            fn()
        devlib.synchronize(self.dev)
        if self.events is None:
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        run, graph = fn, None
        if self.graph_cls is not None:
            side = devlib.stream_class(self.dev)()
            side.wait_stream(devlib.current_stream(self.dev))
            with devlib.stream_context(self.dev, side):
                fn()                                   # compiled and allocated off-capture
            devlib.current_stream(self.dev).wait_stream(side)
            graph = self.graph_cls()
            with devlib.graph_context(self.dev, graph):
                fn()
            run = graph.replay
            run()
        pairs = []
        for _ in range(self.iters):
            if self.flush is not None:
                self.flush.zero_()
            start, end = self.events(enable_timing=True), self.events(enable_timing=True)
            start.record()
            run()
            end.record()
            pairs.append((start, end))
        devlib.synchronize(self.dev)
        del graph
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)


def _read_table(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_table(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = {k: dict(sorted(v.items(), key=lambda kv: int(kv[0])))
               for k, v in sorted(table.items()) if not k.startswith("_")}
    body = {"_meta": table.get("_meta", {}), **entries}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="tune_fused_moe", description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", choices=sorted(MODELS),
                   help="model shape (repeatable; default: all of them)")
    p.add_argument("--shape", action="append", type=_shape, default=[],
                   help="a custom shape E,top_k,H,I (repeatable)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: I / tp per rank")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--batch-sizes", type=_ints, default=None,
                   help="M values (default 1,2,4,...,4096)")
    p.add_argument("--space", choices=("quick", "full"), default="quick")
    p.add_argument("--smem-kib", type=int, default=200,
                   help="shared memory per program the configurations may use (H200: 227)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--flush-mib", type=int, default=256, help="L2 flush buffer (0: none)")
    p.add_argument("--no-graphs", action="store_true",
                   help="time eager calls instead of graph replays (includes launch overhead)")
    p.add_argument("--out", default=None,
                   help="table to write/merge (default: the device's file in the config dir)")
    p.add_argument("--overwrite", action="store_true", help="re-tune (shape, M) in the table")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after the M that crosses this much wall time (resume later)")
    p.add_argument("--compare-align", action="store_true",
                   help="also time the Triton and the torch alignment per M")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shape, two configurations, one call (CPU: Triton interpreter)")
    args = p.parse_args(argv)

    dev = devlib.resolve_device("auto")
    if not devlib.is_accelerator(dev):
        if not args.dry_run:
            raise SystemExit("tune_fused_moe needs a CUDA/XPU device (or --dry-run)")
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernels are defined
    from kernels.moe.fused_moe import fused_moe, moe_align_block_size
    from kernels.moe.reference import fused_moe_torch, moe_align_block_size_torch, select_experts

    dtype = DTYPES[args.dtype]
    if args.dry_run:
        shapes = {"dry-run": DRY_SHAPE}
        batch_sizes = args.batch_sizes or DRY_BATCH_SIZES
        dtype = torch.float16 if dtype == torch.bfloat16 and dev == "cpu" else dtype
        warmup, iters, flush = 0, 1, 0
    else:
        names = args.model or ([] if args.shape else sorted(MODELS))
        shapes = {n: MODELS[n] for n in names}
        shapes.update({f"E={s[0]},top_k={s[1]},H={s[2]},I={s[3]}": s for s in args.shape})
        batch_sizes = args.batch_sizes or BATCH_SIZES
        warmup, iters, flush = args.warmup, args.iters, args.flush_mib
    name = devlib.device_name(dev) if devlib.is_accelerator(dev) else "cpu-interpreter"
    if args.out:
        out_path = Path(args.out)
    elif args.dry_run:
        out_path = Path(tempfile.mkdtemp(prefix="ferry-moe-")) / "dry_run.json"
    else:
        out_path = moe_config.config_dir() / moe_config.device_config_file(name)
    table = _read_table(out_path)
    table["_meta"] = {**table.get("_meta", {}), "device_name": name,
                      "written_by": "bench/kernels/tune_fused_moe.py", "torch": torch.__version__,
                      "triton": __import__("triton").__version__}
    timer = Timer(dev, warmup, iters, flush, graphs=not args.no_graphs)
    t_start = time.time()
    print(f"# fused MoE tuning on {name} ({dev}), {moe_config.dtype_name(dtype)}, "
          f"space {args.space}; table: {out_path}")
    print("| shape | M | configs | best us | default us | speedup | best config |")
    print("|---|---|---|---|---|---|---|")
    for label, (num_experts, top_k, hidden, inter) in shapes.items():
        if inter % args.tp:
            raise SystemExit(f"{label}: I={inter} is not divisible by --tp {args.tp}")
        inter //= args.tp
        key = moe_config.table_key(num_experts, inter, hidden, dtype)
        buckets = table.setdefault(key, {})
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn((num_experts, 2 * inter, hidden), generator=g)
               / math.sqrt(hidden)).to(dtype).to(dev)
        w2 = (torch.randn((num_experts, hidden, inter), generator=g)
              / math.sqrt(inter)).to(dtype).to(dev)
        for m in batch_sizes:
            if str(m) in buckets and not args.overwrite:
                print(f"| {label} | {m} | (in the table) | | | | |")
                continue
            x = torch.randn((m, hidden), generator=g).to(dtype).to(dev)
            tw, ti = select_experts(torch.randn((m, num_experts), generator=g), top_k, True)
            tw, ti = tw.to(dev), ti.to(dev)
            out = torch.empty((m, hidden), dtype=dtype, device=dev)
            if args.dry_run:
                base = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1,
                            num_warps=4, num_stages=2)
                configs = [base, dict(base, BLOCK_SIZE_N=16, GROUP_SIZE_M=4)]
            else:
                configs = search_space(args.space, m, top_k, num_experts, dtype, dev,
                                       args.smem_kib)
            results, failed = [], 0
            for cfg in configs:
                try:
                    us = timer(partial(fused_moe, x, w13, w2, tw, ti, config=cfg, out=out))
                except Exception as e:  # noqa: BLE001 - out of resources etc.: skip it
                    failed += 1
                    if args.dry_run:
                        raise
                    print(f"  (skipped {cfg}: {type(e).__name__}: {str(e)[:120]})",
                          file=sys.stderr)
                    continue
                results.append((us, cfg))
            if not results:
                print(f"| {label} | {m} | 0 of {len(configs)} ran | | | | |")
                continue
            best_us, best = min(results, key=lambda r: r[0])
            default = moe_config.default_moe_config(m, num_experts, inter, hidden, top_k,
                                                    dtype, dev)
            default_us = timer(partial(fused_moe, x, w13, w2, tw, ti, config=default, out=out))
            got = fused_moe(x, w13, w2, tw, ti, config=best)
            ref = fused_moe_torch(x.float(), w13.float(), w2.float(), tw, ti)
            err = ((got.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if not err < TOL[dtype]:
                print(f"MISMATCH {label} M={m} {best}: relative error {err:.3g}")
            print(f"| {label} | {m} | {len(results)}/{len(configs)} | {best_us:.1f} | "
                  f"{default_us:.1f} | {default_us / best_us:.2f} | {json.dumps(best)} |")
            if args.compare_align:
                bm = best["BLOCK_SIZE_M"]
                a_tri = timer(partial(moe_align_block_size, ti, bm, num_experts))
                a_tor = timer(partial(moe_align_block_size_torch, ti, bm, num_experts))
                print(f"|   align M={m} BM={bm} | triton {a_tri:.1f} us | torch {a_tor:.1f} us |")
            buckets[str(m)] = best
            table["_meta"].setdefault("best_us", {}).setdefault(key, {})[str(m)] = \
                round(best_us, 2)
            _write_table(out_path, table)
            if args.max_minutes and time.time() - t_start > 60 * args.max_minutes:
                print(f"# stopped after {args.max_minutes} min; run again to resume")
                moe_config.clear_cache()
                return
        del w13, w2
        devlib.empty_cache(dev)
    moe_config.clear_cache()
    print(f"# wrote {out_path} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
