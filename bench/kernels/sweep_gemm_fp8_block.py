"""Block-wise FP8 GEMM (``kernels.fp8.block_triton``) against bf16 ``F.linear`` on a GPU.

``python -m bench.kernels.sweep_gemm_fp8_block [--batch-sizes 1,16,64,256,2048]
[--shapes v3_wide,v3_qkv_a,q3_gate_up] [--no-sweep] [--result-json F]``

Shapes (N, K): DeepSeek-V3's 18432 x 7168 (its dense MLP width) and 2112 x 7168 (the fused
``q_a`` + ``kv_a`` projection), Qwen3-8B's 12288 x 4096 (``gate`` or ``up``), with 128 x 128
blocks. Per shape and M, device microseconds per call (the median of 7 replays of a CUDA
graph of calls, after a warm-up, cycling through enough weight copies that no call finds its
weights in the L2; :func:`bench.kernels.sweep_gemm_fp8.time_per_call`) of: bf16
``F.linear``; ``layer`` (what ``Fp8BlockLinearMethod`` runs: weight-only at M <= 16, else
the activation quantizer + W8A8 on the FP8 tensor cores, default configs); ``w8a8`` and
``weight-only`` at every M (default configs); and, unless ``--no-sweep``, the best of a small
grid of launch configs of the layer's mode, with the default's rank. The error column is
the layer path's relative error norm against the fp32 product of the dequantized operands.
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import torch.nn.functional as F

from bench.kernels.sweep_gemm_fp8 import L2_DEFEAT_BYTES, time_per_call
from engine import device as devlib
from kernels.fp8.block_triton import block_gemm_config, fp8_block_linear
from kernels.fp8.constants import WEIGHT_ONLY_MAX_M
from kernels.fp8.reference import dequantize_weight_blocks, quantize_weight_blocks

SHAPES = {"v3_wide": (18432, 7168), "v3_qkv_a": (2112, 7168), "q3_gate_up": (12288, 4096)}
BLOCK = (128, 128)


def _configs(m: int):
    if m <= 64:
        block_m = max(16, 1 << (m - 1).bit_length())
        for bn, split, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (3, 4)):
            yield dict(SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=bn, num_warps=4,
                       num_stages=stages)
        return
    for bm, bn, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (3, 4)):
        yield dict(SPLIT_K=1, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


def _name(c: dict) -> str:
    return (f"m{c['BLOCK_M']} n{c['BLOCK_N']} split{c['SPLIT_K']} w{c['num_warps']} "
            f"s{c['num_stages']}")


def _time_block(dev: str, x: torch.Tensor, wqs: list, ss: list, quant_x: bool,
                cfg: dict | None = None) -> float:
    return time_per_call(dev, [partial(fp8_block_linear, x, a, b, BLOCK[1], BLOCK[0],
                                       quant_x=quant_x, config=cfg) for a, b in zip(wqs, ss)])


def _bench_shape(dev: str, name: str, n: int, k: int, batch_sizes: list[int], sweep: bool,
                 g: torch.Generator) -> list[dict]:
    copies = max(2, -(-L2_DEFEAT_BYTES // (n * k)))
    w = torch.randn((n, k), generator=g).mul_(0.02).to(dev)
    wq, s = quantize_weight_blocks(w, BLOCK)
    wqs, ss = [wq.clone() for _ in range(copies)], [s.clone() for _ in range(copies)]
    wbs = [w.to(torch.bfloat16) for _ in range(copies)]
    wdeq = dequantize_weight_blocks(wq, s, BLOCK[1], BLOCK[0])
    del w
    rows = []
    for m in batch_sizes:
        x = torch.randn((m, k), generator=g).to(torch.bfloat16).to(dev)
        layer_wo = m <= WEIGHT_ONLY_MAX_M

        run = partial(_time_block, dev, x, wqs, ss)
        ref = x.float() @ wdeq.t()
        out = fp8_block_linear(x, wq, s, BLOCK[1], BLOCK[0], quant_x=not layer_wo).float()
        row = {"shape": name, "n": n, "k": k, "m": m,
               "err": float((out - ref).norm() / ref.norm()),
               "bf16": time_per_call(dev, [partial(F.linear, x, wb) for wb in wbs]),
               "w8a8": run(True), "weight_only": run(False),
               "default": _name(block_gemm_config(m, n, k, BLOCK[1], layer_wo))}
        row["layer"] = row["weight_only" if layer_wo else "w8a8"]
        if sweep:
            grid = []
            for cfg in _configs(m):
                try:
                    grid.append((run(not layer_wo, cfg), _name(cfg)))
                except Exception as e:  # noqa: BLE001 - a config that does not fit
                    print(f"    {_name(cfg)}: {type(e).__name__}")
            grid.sort()
            row["sweep"] = grid
            row["default_rank"] = next((i for i, (_, c) in enumerate(grid)
                                        if c == row["default"]), None)
        rows.append(row)
        _print_row(row)
    del wqs, ss, wbs, wdeq
    devlib.empty_cache(dev)
    return rows


def _print_row(r: dict) -> None:
    n, k = r["n"], r["k"]
    flops = 2 * r["m"] * n * k
    cells = [f"{r[c]:8.1f} ({n * k * b / r[c] / 1e3:5.0f} GB/s, {flops / r[c] / 1e6:5.0f} TF)"
             for c, b in (("bf16", 2), ("layer", 1), ("w8a8", 1), ("weight_only", 1))]
    print(f"{r['shape']:11s} {r['m']:5d} " + " | ".join(cells)
          + f"  x{r['bf16'] / r['layer']:.2f}  err {r['err']:.1e}", flush=True)
    if "sweep" in r and r["sweep"]:
        print("    best: " + ", ".join(f"{c} {u:.1f}us" for u, c in r["sweep"][:3])
              + f"; default ({r['default']}) rank {r['default_rank']}", flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,16,64,256,2048")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--no-sweep", action="store_true", help="default configs only")
    p.add_argument("--result-json", default=None)
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    dev = devlib.resolve_device(args.device)
    if not devlib.is_accelerator(dev):
        raise SystemExit("sweep_gemm_fp8_block needs a CUDA or XPU device")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"{devlib.device_name(dev)}; us per call (weight GB/s, TFLOP/s); L2 defeated; "
          "columns: bf16 | layer (weight-only at M <= 16, else W8A8) | w8a8 | weight-only")
    g = torch.Generator().manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        rows += _bench_shape(dev, name, n, k, batch_sizes, not args.no_sweep, g)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
