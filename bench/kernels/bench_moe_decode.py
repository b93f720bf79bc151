"""The MoE experts at decode sizes: the two-launch decode path
(:mod:`kernels.moe.fused_moe_decode`) against the six-launch grouped path (the device's tuned
table), per shape and M, in one call.

``python -m bench.kernels.bench_moe_decode [--batch-sizes 1,2,4,8,16] [--tiles 1024,4096
--tiles 512,8192 ...]`` prints, per shape (Qwen3-30B-A3B: E=128, top-8, H=2048, I=768;
Mixtral-8x7B: E=8, top-2, H=4096, I=14336) and M, the grouped path's time, the decode
path's with each ``--tiles`` choice (target programs, weight elements a step:
:func:`kernels.moe.fused_moe_decode.decode_tiles`), decode / grouped, and the fraction of the
weight-read bound (the experts the routing touches x 3 H I x 2 bytes at ``--peak-gbs``).
Timing: :class:`bench.kernels.tune_fused_moe.Timer` (graph replays, L2 flushed before each
call, median). On the CPU (``--dry-run``) a tiny shape runs in the Triton interpreter.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from bench.kernels.tune_fused_moe import MODELS, Timer
from engine import device as devlib
from kernels.moe.fused_moe import fused_moe
from kernels.moe.fused_moe_decode import decode_tiles, fused_moe_decode
from kernels.moe.reference import select_experts


def _pair(s: str) -> tuple[int, int]:
    a, b = s.split(",")
    return int(a), int(b)


def bench_shape(name: str, shape: tuple[int, int, int, int], batch_sizes: list[int],
                tiles: list[tuple[int, int]], timer: Timer, dev: str, peak_gbs: float,
                dtype: torch.dtype = torch.bfloat16) -> list:
    """One shape's rows: dicts with M, grouped_us, decode_us per tiles, bound_us; a
    ``MISMATCH`` line when a decode output is off the grouped one by more than 3e-2."""
    num_experts, top_k, h, inter = shape
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, h, generator=g) / h ** 0.5).to(dtype).to(dev)
    w2 = (torch.randn(num_experts, h, inter, generator=g) / inter ** 0.5).to(dtype).to(dev)
    name_dev = devlib.device_name(dev) if devlib.is_accelerator(dev) else None
    rows = []
    for m in batch_sizes:
        x = torch.randn(m, h, generator=g).to(dtype).to(dev)
        w, ids = select_experts(torch.randn(m, num_experts, generator=g), top_k, True)
        w, ids = w.to(dev), ids.to(dev)
        out = torch.empty(m, h, dtype=dtype, device=dev)
        touched = len(set(ids.flatten().tolist()))
        bound_us = touched * 3 * h * inter * 2 / (peak_gbs * 1e3)
        row = {"shape": name, "M": m, "experts_touched": touched, "bound_us": bound_us,
               "grouped_us": timer(partial(fused_moe, x, w13, w2, w, ids, out=out,
                                           decode=False, device_name=name_dev))}
        for progs, elems in tiles:
            t = decode_tiles(m, top_k, h, inter, progs, elems)
            key = f"decode_{progs}_{elems}"
            row[key] = timer(partial(fused_moe_decode, x, w13, w2, w, ids, out, t))
            row[key + "_tiles"] = t
            want = fused_moe(x, w13, w2, w, ids, decode=False, device_name=name_dev).double()
            err = ((fused_moe_decode(x, w13, w2, w, ids, out, t).double() - want).norm()
                   / want.norm()).item()
            if not err < 3e-2:
                print(f"MISMATCH {name} M={m} tiles {t}: relative error {err:.3g}")
        rows.append(row)
        parts = [f"{name} M={m:<3} touched {touched:3d} bound {bound_us:7.1f} us | grouped "
                 f"{row['grouped_us']:7.1f} us"]
        for progs, elems in tiles:
            us = row[f"decode_{progs}_{elems}"]
            parts.append(f"decode[{progs},{elems}] {us:7.1f} us ({us / row['grouped_us']:.2f}x"
                         f" grouped, {bound_us / us:.2f} of bound)")
        print(" | ".join(parts), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench_moe_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", choices=sorted(MODELS))
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--tiles", action="append", type=_pair,
                   help="decode tiles 'target programs,elements' (repeatable; default "
                        "1024,4096 512,4096 2048,2048 1024,8192)")
    p.add_argument("--peak-gbs", type=float, default=4270.0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--result-json", default=None)
    p.add_argument("--dry-run", action="store_true", help="a tiny shape (the CPU interpreter)")
    ns = p.parse_args(argv)
    dev = devlib.resolve_device("auto")
    tiles = ns.tiles or [(1024, 4096), (512, 4096), (2048, 2048), (1024, 8192)]
    if ns.dry_run:
        shapes = {"dry": (8, 2, 64, 48)}
        sizes, tiles = [1, 3], tiles[:2]
    else:
        shapes = {m: MODELS[m] for m in (ns.model or sorted(MODELS))}
        sizes = [int(v) for v in ns.batch_sizes.split(",")]
    timer = Timer(dev, warmup=1 if ns.dry_run else 3, iters=1 if ns.dry_run else ns.iters,
                  flush_mib=256)
    rows = []
    for name, shape in shapes.items():
        rows += bench_shape(name, shape, sizes, tiles, timer, dev, ns.peak_gbs,
                            torch.float16 if ns.dry_run else torch.bfloat16)
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
