"""4-bit weight-only GEMMs (AWQ/GPTQ's q4 layout, groups of 128) against bf16 on a GPU.

``python -m bench.kernels.sweep_gemm_wq [--batch-sizes 1,16,64,256,2048] [--configs]
[--result-json F]`` times, for the Llama-3-8B projections, bf16 ``F.linear`` and
:func:`kernels.quant.wq_triton.wq_linear` with its default launch (the split-K decode tiles
up to M = 16, larger tiles up to 256, dequantize + GEMM above) on the same random weight
quantized to 4 bits (fp32 scale and min per 128 weights, as AWQ/GPTQ checkpoints load).
``--configs 1,4,16,64,512`` also sweeps the kernels' launch parameters at those M (the GEMV
kernel up to M = 4, the tiled kernel above: tiles, split, warps, stages), for a better rule
in ``wq_config``; it prints the three best per shape and M. Each figure is one call's
device time from a CUDA graph of calls that cycle through >= 256 MB of weight copies (no
call finds its weights in the L2), median of 7 replays; GB/s counts the weight bytes of the
call's format (4-bit: nibbles + scales + mins). Above ``DEQUANT_MIN_M`` rows the last column
times the tiled kernel itself (what ``FERRY_WQ_DEQUANT_MIN_M`` set higher would run). GPU
only, but ``--smoke`` checks the calls on the CPU in the Triton interpreter.
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import torch.nn.functional as F

from bench.kernels.sweep_gemm_fp8 import L2_DEFEAT_BYTES, SHAPES, time_per_call
from engine import device as devlib
from engine.layers.quantization.int4 import quantize_rtn
from kernels.quant.reference import dequant, pack_q4
from kernels.quant.wq_triton import DEQUANT_MIN_M, wq_config, wq_dequant, wq_linear

GROUP = 128
#: dequantization programs timed by --configs (rows, weights of K, warps)
DEQUANT_BLOCKS = [(32, 128, 4), (16, 256, 4), (32, 256, 4), (64, 256, 8), (32, 512, 8)]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _copies(dev: str, n: int, k: int, g: torch.Generator, dtype=torch.bfloat16,
            min_copies: int = 2):
    """Weight copies (``dtype`` and 4-bit) that together defeat the L2."""
    w = (torch.randn((n, k), generator=g) * 0.02).to(dev)
    q, s, z = quantize_rtn(w, GROUP, symmetric=False)
    packed = (pack_q4(q), s.float(), -s.float() * z.float())
    wb = dequant("q4", *packed, dtype=dtype)
    copies = max(min_copies, -(-L2_DEFEAT_BYTES // (n * k * 2)) if min_copies > 1 else 1)
    return ([wb.clone() for _ in range(copies)],
            [tuple(t.clone() for t in packed) for _ in range(copies)])


def _configs(m: int):
    """Launch configs swept at ``m`` rows: the GEMV kernel (M <= 4) and the tiled one."""
    if m <= 4:
        for bn, bk, split, warps, stages in itertools.product((32, 64, 128, 256), (128, 256),
                                                              (2, 4, 8), (4, 8), (1, 2)):
            yield dict(GEMV=True, SPLIT_K=split, BLOCK_M=1 << (m - 1).bit_length(),
                       BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    if 4 <= m <= 16:
        for bn, bk, split, warps, stages in itertools.product((32, 64, 128), (128,),
                                                              (1, 2, 4, 8), (4, 8), (3, 4)):
            yield dict(SPLIT_K=split, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                       num_stages=stages)
    if 16 < m <= 256:
        for bm, bn, split, warps, stages in itertools.product((32, 64), (64, 128), (1, 2, 4),
                                                              (4, 8), (3, 4)):
            yield dict(SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=warps,
                       num_stages=stages)
    if m > 256:
        for bm, bn, bk, warps, stages in itertools.product((64, 128), (64, 128, 256), (64, 128),
                                                           (4, 8), (3, 4)):
            if bm * bn <= 128 * 128:
                yield dict(SPLIT_K=1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                           num_stages=stages)


def smoke(batch_sizes: list[int]) -> list[dict]:
    """CPU check of this script's calls (the Triton interpreter, ``TRITON_INTERPRET=1``, set
    before ``kernels.quant.wq_triton`` is imported): a 72 x 256 weight, fp16 activations,
    each path's error against the fp16 ``F.linear`` of the dequantized weight and one
    call's host time (not a benchmark)."""
    import time

    g = torch.Generator().manual_seed(0)
    wbs, wqs = _copies("cpu", 72, 256, g, dtype=torch.float32, min_copies=1)
    rows = []
    for m in batch_sizes:
        x = torch.randn((m, 256), generator=g).half()
        ref = F.linear(x.float(), wbs[0])
        t0 = time.perf_counter()
        y = wq_linear(x, "q4", *wqs[0])
        dt = time.perf_counter() - t0
        err = ((y.float() - ref).norm() / ref.norm()).item()
        rows.append(dict(shape="smoke", m=m, int4_s=dt, rel_err=err,
                         path="dequant" if m > DEQUANT_MIN_M else "kernel"))
        print(f"smoke M={m}: {rows[-1]['path']}, rel err {err:.1e}, {dt * 1e3:.0f} ms")
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="sweep_gemm_wq", description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=_ints, default=[1, 16, 64, 256, 2048])
    p.add_argument("--configs", type=_ints, nargs="?", const=[1, 16], default=None,
                   help="sweep launch configs at these M (default 1,16), e.g. 1,4,64,512")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the calls in the Triton interpreter (see smoke())")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        return {"rows": smoke(args.batch_sizes)}
    dev = devlib.resolve_device("auto")
    if not devlib.is_accelerator(dev):
        raise SystemExit("sweep_gemm_wq needs a GPU (or --smoke)")
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{devlib.device_name(dev)}; us per call (weight GB/s)")
    print(f"{'shape':8s} {'M':>5s} {'bf16':>16s} {'int4':>16s} {'int4/bf16':>9s} {'err':>8s} "
          f"{'kernel':>8s}")
    for name, (n, k) in SHAPES.items():
        wbs, wqs = _copies(dev, n, k, g)
        q_bytes = n * k // 2 + 2 * 4 * n * k // GROUP
        for m in args.batch_sizes:
            x = torch.randn((m, k), generator=g).to(dev, torch.bfloat16)
            ref = F.linear(x, wbs[0]).float()
            err = ((wq_linear(x, "q4", *wqs[0]).float() - ref).norm() / ref.norm()).item()
            t_bf = time_per_call(dev, [partial(F.linear, x, w) for w in wbs])
            t_q = time_per_call(dev, [partial(wq_linear, x, "q4", *w) for w in wqs])
            cfg = wq_config(m, n, k, GROUP, torch.device(dev).type)
            t_kernel = None
            if m > DEQUANT_MIN_M:  # the tiled kernel where the default dequantizes + GEMM
                t_kernel = time_per_call(dev, [partial(wq_linear, x, "q4", *w, config=cfg)
                                               for w in wqs])
            rows.append(dict(shape=name, m=m, bf16_us=t_bf, int4_us=t_q, rel_err=err,
                             config=cfg if m <= DEQUANT_MIN_M else "dequant",
                             kernel_us=t_kernel))
            print(f"{name:8s} {m:5d} {t_bf:8.1f} ({n * k * 2 / t_bf / 1e3:5.0f}) "
                  f"{t_q:8.1f} ({q_bytes / t_q / 1e3:5.0f}) {t_q / t_bf:9.2f} {err:8.1e} "
                  + (f"{t_kernel:8.1f}" if t_kernel is not None else f"{'':8s}"))
        if args.configs:
            out = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
            for blk in DEQUANT_BLOCKS:  # the prefill path's dequantization alone
                t = time_per_call(dev, [partial(wq_dequant, "q4", *w, torch.bfloat16, blk)
                                        for w in wqs])
                rows.append(dict(shape=name, dequant_block=blk, dequant_us=t))
                print(f"  {name} dequant {blk}: {t:7.1f} us ({(q_bytes + out.numel() * 2) / t / 1e3:5.0f} GB/s)")
            del out
            for m in args.configs:
                x = torch.randn((m, k), generator=g).to(dev, torch.bfloat16)
                best = []
                for cfg in _configs(m):
                    try:
                        t = time_per_call(dev, [partial(wq_linear, x, "q4", *w, config=cfg)
                                                for w in wqs])
                    except Exception as e:  # noqa: BLE001 - a config that does not compile
                        print(f"  {name} M={m} {cfg}: {type(e).__name__}")
                        continue
                    best.append((t, cfg))
                    rows.append(dict(shape=name, m=m, int4_us=t, config=cfg))
                best.sort(key=lambda r: r[0])
                for t, cfg in best[:3]:
                    print(f"  {name} M={m}: {t:7.1f} us ({q_bytes / t / 1e3:5.0f} GB/s) {cfg}")
        del wbs, wqs
        devlib.empty_cache(dev)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return {"rows": rows}


if __name__ == "__main__":
    main()
