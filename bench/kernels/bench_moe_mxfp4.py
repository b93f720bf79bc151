"""gpt-oss's fused MoE with MXFP4 experts against the same MoE with bf16 experts, and the
MXFP4 GEMV path against the grouped GEMM.

``python -m bench.kernels.bench_moe_mxfp4`` times :func:`kernels.moe.fused_moe_mxfp4.fused_moe_oai`
(biases, clamped SwiGLU, routed top-k) on one layer of the shipped shapes, once with the
experts as MXFP4 blocks and e8m0 scales (4.25 bits a weight, dequantized in registers; the
grouped ``tl.dot`` GEMM, ``gemv=False``) and once with the same (dequantized) values in
bf16, for each M (tokens in the batch). At ``M <= --gemv-max-m`` it also times the GEMV path
(:func:`kernels.moe.fused_moe_mxfp4_gemv.fused_moe_oai_gemv`, two launches) with its default
tiles (``gemv``), the self-routed variant the engine runs (``routed``: routing inside the
kernels; against ``fused_topk`` + the GEMV path, ``topk+gemv``, the engine's choice with
``FERRY_MXFP4_GEMV_ROUTE=0``, and ``fused_topk`` + the grouped GEMM, ``topk+grouped``, the
engine's path before), and every tile variant
of ``--gemv-tiles`` (``target_programs,block_k`` pairs, ``FERRY_MXFP4_GEMV_TILES``'s format:
the line to pick the default from). Each
figure is the median device time of ``--iters`` calls after ``--warmup`` (device events
around a replayed graph of the call, the L2 flushed before each: ``bench.kernels.tune_fused_moe``'s
``Timer``). The launch configuration is the one the engine picks (``get_moe_config``).

Per line: the experts the routing touches, the weight bytes they hold (MXFP4: blocks +
scales; bf16: 2 bytes a weight; biases left out), the achieved GB/s over those bytes and
the fraction of ``--peak-gbs`` (4250: the H200 figure docs/benchmarks.md's roofline uses),
and the MXFP4 speed-up over bf16 (the GEMV lines: over the grouped GEMM). Shapes: ``gpt-oss-20b`` (32 experts, top-4) and
``gpt-oss-120b`` (128 experts, top-4), hidden = intermediate = 2880. The routing is softmax
top-k of random logits. ``--dry-run``: a tiny shape, one timed call (the Triton interpreter
on the CPU: fp16 there, since a bf16 ``tl.dot`` is unreliable in it).
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from bench.kernels.tune_fused_moe import Timer
from engine import device as devlib
from kernels.moe import fused_moe_mxfp4_gemv as gemv_mod
from kernels.moe.fused_moe_mxfp4 import fused_moe_oai
from kernels.moe.mxfp4 import dequantize_mxfp4
from kernels.moe.routing import fused_topk

#: name -> (experts, top_k, hidden, intermediate)
SHAPES = {"gpt-oss-20b": (32, 4, 2880, 2880), "gpt-oss-120b": (128, 4, 2880, 2880)}
DRY_SHAPE = (8, 2, 64, 64)


def _mxfp4(num_experts: int, rows: int, k: int, device: str, gen: torch.Generator):
    """Random MXFP4 blocks ``[E, rows, k/32, 16]`` and scales near 2^-6 (as the dummy
    loader draws them), on ``device``."""
    blocks = torch.randint(0, 256, (num_experts, rows, k // 32, 16), generator=gen,
                           dtype=torch.uint8)
    scales = torch.randint(119, 124, (num_experts, rows, k // 32), generator=gen,
                           dtype=torch.uint8)
    return blocks.to(device), scales.to(device)


def _fmt(rec: dict) -> str:
    return f"{rec['us']:8.1f} us {rec['gbs']:7.0f} GB/s ({rec['of_peak']:.2f})"


def bench_gemv(rec: dict, args: tuple, kw: dict, logits, timer: Timer, nbytes: int,
               peak_gbs: float, variants: list[tuple[int, int]],
               default_target: int | None = None) -> None:
    """Time the GEMV path of one shape and M into ``rec`` (``gemv``, ``routed``,
    ``topk+gemv``, ``topk+grouped``, ``tiles``) and print its lines; ``default_target``: the default
    tiles' ``target_programs`` (None: the module's)."""
    x, w13, w2, s13, s2, weights, ids = args
    m, h = x.shape
    top_k, inter = ids.shape[1], w13.shape[1] // 2

    def timed(fn) -> dict:
        us = timer(fn)
        gbs = nbytes / us / 1e3
        return {"us": round(us, 2), "gbs": round(gbs, 1), "of_peak": round(gbs / peak_gbs, 3)}

    g = partial(gemv_mod.fused_moe_oai_gemv, x, w13, w2, s13, s2, **kw)
    default = gemv_mod.gemv_tiles(m, top_k, h, inter, default_target)
    rec["gemv"] = timed(partial(g, weights, ids, tiles=default))
    rec["gemv"]["tiles"] = default
    rec["routed"] = timed(partial(g, None, None, route=(logits, top_k, True), tiles=default))
    grouped = partial(fused_moe_oai, x, w13, w2, w13_scales=s13, w2_scales=s2, gemv=False,
                      **kw)
    rec["topk+grouped"] = timed(lambda: grouped(*fused_topk(logits, top_k, True)))
    rec["topk+gemv"] = timed(lambda: g(*fused_topk(logits, top_k, True), tiles=default))
    base = rec["mxfp4"]["us"]
    print(f"{'':13s} M={m:<4d} gemv   {_fmt(rec['gemv'])}  x{base / rec['gemv']['us']:.2f} "
          f"over grouped  tiles {rec['gemv']['tiles']}", flush=True)
    print(f"{'':13s} M={m:<4d} routed {_fmt(rec['routed'])}  topk+gemv "
          f"{rec['topk+gemv']['us']:8.1f} us  topk+grouped {rec['topk+grouped']['us']:8.1f} us"
          f"  x{rec['topk+grouped']['us'] / rec['routed']['us']:.2f}", flush=True)
    rec["tiles"] = []
    for target, bk in variants:
        tiles = gemv_mod.gemv_tiles(m, top_k, h, inter, target, bk)
        r = timed(partial(g, weights, ids, tiles=tiles))
        rec["tiles"].append({"target_programs": target, "block_k": bk, "tiles": tiles, **r})
        print(f"{'':13s} M={m:<4d}   tiles {target},{bk:<5d} {_fmt(r)}  {tiles}", flush=True)


def bench_shape(name: str, shape: tuple[int, int, int, int], ms: list[int], dtype, device: str,
                timer: Timer, peak_gbs: float, gemv_max_m: int = 8,
                variants: list[tuple[int, int]] = (),
                default_target: int | None = None, variants_max_m: int = 8) -> list[dict]:
    """Time both weight formats of one shape at every M, and the GEMV path up to
    ``gemv_max_m`` (with each tile variant up to ``variants_max_m``); returns one record
    per M."""
    e, k, h, inter = shape
    g = torch.Generator().manual_seed(0)
    w13, s13 = _mxfp4(e, 2 * inter, h, device, g)
    w2, s2 = _mxfp4(e, h, inter, device, g)
    b13 = (0.1 * torch.randn(e, 2 * inter, generator=g)).to(device, dtype)
    b2 = (0.1 * torch.randn(e, h, generator=g)).to(device, dtype)
    d13, d2 = dequantize_mxfp4(w13, s13, dtype), dequantize_mxfp4(w2, s2, dtype)
    per_expert = {"mxfp4": (w13[0].numel() + s13[0].numel() + w2[0].numel() + s2[0].numel()),
                  "bf16": (d13[0].numel() + d2[0].numel()) * d13.element_size()}
    kw = dict(w13_bias=b13, w2_bias=b2, activation="swiglu_oai", swiglu_alpha=1.702,
              swiglu_limit=7.0, device_name=devlib.device_name(device))
    out = []
    for m in ms:
        x = torch.randn(m, h, generator=g).to(device, dtype)
        logits = torch.randn(m, e, generator=g).to(device)
        weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
        weights, ids = (weights / weights.sum(-1, keepdim=True)), ids.to(torch.int32)
        touched = int(torch.unique(ids).numel())
        rec = {"shape": name, "m": m, "experts_touched": touched}
        runs = {"mxfp4": partial(fused_moe_oai, x, w13, w2, weights, ids, w13_scales=s13,
                                 w2_scales=s2, gemv=False, **kw),
                "bf16": partial(fused_moe_oai, x, d13, d2, weights, ids, **kw)}
        for fmt, fn in runs.items():
            us = timer(fn)
            nbytes = touched * per_expert[fmt]
            gbs = nbytes / us / 1e3
            rec[fmt] = {"us": round(us, 2), "weight_bytes": nbytes, "gbs": round(gbs, 1),
                        "of_peak": round(gbs / peak_gbs, 3)}
        rec["speedup"] = round(rec["bf16"]["us"] / rec["mxfp4"]["us"], 2)
        print(f"{name:13s} M={m:<4d} experts={touched:<3d} "
              f"mxfp4 {rec['mxfp4']['us']:8.1f} us {rec['mxfp4']['gbs']:7.0f} GB/s "
              f"({rec['mxfp4']['of_peak']:.2f})  bf16 {rec['bf16']['us']:8.1f} us "
              f"{rec['bf16']['gbs']:7.0f} GB/s ({rec['bf16']['of_peak']:.2f})  "
              f"x{rec['speedup']:.2f}", flush=True)
        if m <= gemv_max_m:
            gkw = {k: kw[k] for k in ("w13_bias", "w2_bias", "activation", "swiglu_alpha",
                                      "swiglu_limit")}
            bench_gemv(rec, (x, w13, w2, s13, s2, weights, ids), gkw, logits, timer,
                       touched * per_expert["mxfp4"], peak_gbs,
                       variants if m <= variants_max_m else [], default_target)
        out.append(rec)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", choices=sorted(SHAPES),
                    help="shape(s) to time (default: both)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,64,256",
                    help="M values, comma-separated")
    ap.add_argument("--gemv-max-m", type=int, default=8,
                    help="time the GEMV path up to this M (0: never)")
    ap.add_argument("--gemv-tiles", default="528,256;528,1024;264,512;1056,512;132,512",
                    help="GEMV tile variants, target_programs,block_k pairs separated by ';' "
                         "(besides the default; empty: none)")
    ap.add_argument("--gemv-tiles-max-m", type=int, default=8,
                    help="time the tile variants up to this M (each variant compiles anew)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--peak-gbs", type=float, default=4250.0)
    ap.add_argument("--flush-mib", type=int, default=256, help="L2 flush buffer (0: none)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--result-json", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    device = devlib.resolve_device(args.device)
    accel = devlib.is_accelerator(device)
    dtype = torch.bfloat16 if accel else torch.float16
    if args.dry_run:
        shapes, ms = {"dry": DRY_SHAPE}, [1, 3]
        timer = Timer(device, 1, 1, 0, graphs=False)
        # the GEMV path at M = 1 only, with few programs (the interpreter's cost)
        args.gemv_tiles, args.gemv_max_m, default_target = "1,64", 1, 1
    else:
        shapes = {n: SHAPES[n] for n in (args.model or sorted(SHAPES))}
        ms = [int(v) for v in args.batch_sizes.split(",")]
        timer = Timer(device, args.warmup, args.iters, args.flush_mib)
        default_target = None
    print(f"device={device} dtype={str(dtype).replace('torch.', '')} "
          f"peak={args.peak_gbs:.0f} GB/s", flush=True)
    variants = [tuple(int(v) for v in pair.split(",")) for pair in args.gemv_tiles.split(";")
                if pair.strip()]
    records = []
    for name, shape in shapes.items():
        records += bench_shape(name, shape, ms, dtype, device, timer, args.peak_gbs,
                               args.gemv_max_m, variants, default_target,
                               args.gemv_tiles_max_m)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
