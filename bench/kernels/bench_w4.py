"""4-bit GEMMs at batch (issue 49): ferry's row-layout path, ferry's K-major path, bf16
cuBLAS and gemlite on the same weights, for the Llama-3-8B projections.

``python -m bench.kernels.bench_w4 [--batch-sizes 1,16,32,64,128,256,512] [--configs]
[--result-json F] [--smoke]``

Per shape (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336) and M,
one random weight quantized AWQ-style (asymmetric, groups of 128) and timed as:

- ``bf16``: ``F.linear`` on its dequantized bf16 copy (cuBLAS);
- ``old``: :func:`kernels.quant.wq_triton.wq_linear` with its default launch (``q4`` rows
  layout; GEMV to M = 4, split-K tiles to 256, dequantize + cuBLAS above);
- ``new``: :func:`kernels.quant.w4_tc.w4k_linear` with :func:`w4k_config`'s table
  (``q4k`` K-major layout: GEMV to M = 4, the tensor-core kernel to 256, dequantize +
  cuBLAS above; there the tensor-core kernel is timed too, ``new_tc_us``);
- ``gemlite``: ``gemlite.helper.A16Wn(...).from_weights`` (packed over K, bf16 scales and
  ``-z * s`` zeros, its own GEMV / split-K GEMM / GEMM choice by M and its ``fast``
  autotuning, done in the warm-up) when ``gemlite`` imports; else the column is empty.

Each figure is one call's device time (microseconds) from a CUDA graph of calls cycling
through >= 256 MB of weight copies (no call finds its weights in the L2), median of 7
replays after a warm-up (``bench.kernels.sweep_gemm_fp8.time_per_call``); gemlite, if its
call does not capture, by device events around an eager loop (median of 7). GB/s counts
the 4-bit bytes (nibbles + fp32 scale and min per 128 weights: 4.5 bits a weight).
``--configs 16,64,128,512`` also sweeps the new kernel's tiles at those M for the
``--config-shapes`` (o, gate_up) and prints the three best (the numbers for
:data:`kernels.quant.w4_tc.W4K_TABLE`). ``--smoke`` checks old/new on the CPU in
the Triton interpreter (``TRITON_INTERPRET=1`` set before kernels are imported).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from functools import partial

import torch
import torch.nn.functional as F

GROUP = 128
L2_DEFEAT_BYTES = 256 << 20
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _quantized(dev: str, n: int, k: int, g: torch.Generator):
    """``(q [N, K] uint8, s fp16 [N, K/G], z uint8 [N, K/G])`` on ``dev``."""
    from engine.layers.quantization.int4 import quantize_rtn

    w = (torch.randn((n, k), generator=g) * 0.02).to(dev)
    return quantize_rtn(w, GROUP, symmetric=False)


def _layouts(q, s, z):
    from kernels.quant.reference import pack_q4
    from kernels.quant.w4_tc import to_kmajor

    rows = (pack_q4(q), s.float(), -s.float() * z.float())
    return rows, to_kmajor(*rows)


def _gemlite_layer(q, s, z, dtype):
    """A gemlite layer over the same codes (None when gemlite does not import or build)."""
    try:
        from gemlite.helper import A16Wn

        return A16Wn(device=str(q.device), dtype=dtype).from_weights(
            W_q=q, scales=s.to(dtype), zeros=z.to(dtype), W_nbits=4, group_size=GROUP)
    except Exception as e:  # noqa: BLE001 - an optional baseline
        print(f"  gemlite unavailable: {type(e).__name__}: {e}")
        return None


def _eager_time(dev: str, fns: list) -> float:
    """Device microseconds per call from events around an eager loop; median of 7."""
    from engine import device as devlib

    event = devlib.event_class(dev)
    for fn in fns:
        fn()
    devlib.synchronize(dev)
    times = []
    for _ in range(7):
        a, b = event(enable_timing=True), event(enable_timing=True)
        a.record()
        for fn in fns:
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(times)


def _timed(dev: str, fns: list) -> float | None:
    from bench.kernels.sweep_gemm_fp8 import time_per_call

    try:
        return time_per_call(dev, fns)
    except Exception as e:  # noqa: BLE001 - e.g. a call that cannot be captured
        print(f"  graph timing failed ({type(e).__name__}: {e}); eager events instead")
        try:
            return _eager_time(dev, fns)
        except Exception as e2:  # noqa: BLE001
            print(f"  eager timing failed too: {type(e2).__name__}: {e2}")
            return None


def _configs(m: int):
    """The new kernel's tiles swept at ``m`` rows (GEMV up to 4 rows, tensor cores above)."""
    if m <= 4:
        for bn, split, warps, stages in itertools.product((64, 128, 256), (4, 8), (4, 8),
                                                          (2, 3)):
            yield dict(GEMV=True, SPLIT_K=split, BLOCK_M=1 << (m - 1).bit_length(),
                       BLOCK_N=bn, BLOCK_K=128, num_warps=warps, num_stages=stages)
        return
    bms = (16, 32) if m <= 32 else (32, 64) if m <= 64 else (64, 128)
    splits = (1, 2, 4, 8) if m <= 64 else (1, 2) if m <= 256 else (1,)
    for bm, bn, split, warps, stages in itertools.product(bms, (64, 128), splits, (4, 8),
                                                          (3, 4)):
        cfg = dict(SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128 if bm < 128 else 64,
                   num_warps=warps, num_stages=stages)
        yield cfg
        if stages == 3:   # the words loaded once per K (gemlite's way) instead of reshaped
            yield dict(cfg, DUP_LOAD=True)


def _row(name, m, n, k, t_bf, t_old, t_new, t_gl, err_new) -> dict:
    q_bytes = n * k // 2 + 2 * 4 * n * k // GROUP
    fmt = lambda t: f"{t:8.1f} ({q_bytes / t / 1e3:5.0f})" if t else f"{'-':>16s}"  # noqa: E731
    ratio = lambda t: f"{t / t_bf:6.2f}" if t else f"{'-':>6s}"  # noqa: E731
    print(f"{name:8s} {m:5d} {t_bf:8.1f} {fmt(t_old)} {fmt(t_new)} {fmt(t_gl)} "
          f"{ratio(t_old)} {ratio(t_new)} {ratio(t_gl)} {err_new:8.1e}")
    return dict(shape=name, m=m, n=n, k=k, bf16_us=t_bf, old_us=t_old, new_us=t_new,
                gemlite_us=t_gl, new_rel_err=err_new)


def smoke(batch_sizes: list[int]) -> list[dict]:
    """CPU check of the old and new calls in the interpreter on a 72 x 256 weight (fp16
    activations): relative error against the float product."""
    from kernels.quant.w4_tc import w4k_linear
    from kernels.quant.wq_triton import wq_linear

    g = torch.Generator().manual_seed(0)
    rows_l, kmaj = _layouts(*_quantized("cpu", 72, 256, g))
    from kernels.quant.reference import dequant

    w = dequant("q4", *rows_l)
    out = []
    for m in batch_sizes:
        x = torch.randn((m, 256), generator=g).half()
        ref = x.float() @ w.t()
        errs = {}
        for label, y in (("old", wq_linear(x, "q4", *rows_l)), ("new", w4k_linear(x, *kmaj))):
            errs[label] = ((y.float() - ref).norm() / ref.norm()).item()
        out.append(dict(m=m, **errs))
        print(f"smoke M={m}: old {errs['old']:.1e}, new {errs['new']:.1e}")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="bench_w4", description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=_ints, default=[1, 16, 32, 64, 128, 256, 512])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--configs", type=_ints, default=None,
                   help="sweep the new kernel's tiles at these M (e.g. 16,64,128,512)")
    p.add_argument("--config-shapes", default="o,gate_up")
    p.add_argument("--no-gemlite", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        return {"rows": smoke(args.batch_sizes)}
    from engine import device as devlib
    from kernels.quant.reference import dequant
    from kernels.quant.w4_tc import DEQUANT_MIN_M, w4k_config, w4k_linear
    from kernels.quant.wq_triton import wq_linear

    dev = devlib.resolve_device("auto")
    if not devlib.is_accelerator(dev):
        raise SystemExit("bench_w4 needs a GPU (or --smoke)")
    if not args.no_gemlite:
        try:
            import gemlite
            print("gemlite", getattr(gemlite, "__version__", "?"), gemlite.__file__)
        except Exception as e:  # noqa: BLE001 - an optional baseline
            print(f"gemlite does not import: {type(e).__name__}: {e}")
            args.no_gemlite = True
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{devlib.device_name(dev)}; us per call (4-bit weight GB/s); ratios to bf16")
    print(f"{'shape':8s} {'M':>5s} {'bf16':>8s} {'old':>16s} {'new':>16s} {'gemlite':>16s} "
          f"{'old/bf':>6s} {'new/bf':>6s} {'gl/bf':>6s} {'new err':>8s}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        q, s, z = _quantized(dev, n, k, g)
        rows_l, kmaj = _layouts(q, s, z)
        wb = dequant("q4", *rows_l, dtype=torch.bfloat16)
        copies = max(2, -(-L2_DEFEAT_BYTES // (n * k // 2)))
        bf_copies = [wb] + [wb.clone() for _ in range(max(1, -(-L2_DEFEAT_BYTES // (n * k * 2))) - 1)]
        old_c = [rows_l] + [tuple(t.clone() for t in rows_l) for _ in range(copies - 1)]
        new_c = [kmaj] + [tuple(t.clone() for t in kmaj) for _ in range(copies - 1)]
        gl_c = []
        if not args.no_gemlite:
            first = _gemlite_layer(q, s, z, torch.bfloat16)
            if first is not None:
                gl_c = [first] + [_gemlite_layer(q, s, z, torch.bfloat16)
                                  for _ in range(copies - 1)]
        for m in args.batch_sizes:
            x = torch.randn((m, k), generator=g).to(dev, torch.bfloat16)
            ref = F.linear(x.float(), wb.float())
            err = ((w4k_linear(x, *kmaj).float() - ref).norm() / ref.norm()).item()
            t_bf = _timed(dev, [partial(F.linear, x, w) for w in bf_copies])
            t_old = _timed(dev, [partial(wq_linear, x, "q4", *c) for c in old_c])
            t_new = _timed(dev, [partial(w4k_linear, x, *c) for c in new_c])
            t_gl = _timed(dev, [partial(layer, x) for layer in gl_c]) if gl_c else None
            rows.append(_row(name, m, n, k, t_bf, t_old, t_new, t_gl, err))
            cfg = w4k_config(m, n, k, GROUP, torch.device(dev).type)
            rows[-1]["new_config"] = cfg if m <= DEQUANT_MIN_M else "dequant"
            if m > DEQUANT_MIN_M:   # the tensor-core kernel where the default dequantizes
                rows[-1]["new_tc_us"] = _timed(dev, [partial(w4k_linear, x, *c, config=cfg)
                                                     for c in new_c])
                print(f"{'':8s} {m:5d} new tensor-core kernel: {rows[-1]['new_tc_us']:8.1f} us "
                      f"({rows[-1]['new_tc_us'] / t_bf:5.2f} x bf16) {cfg}")
            if args.configs and m in args.configs and name in args.config_shapes.split(","):
                _sweep(dev, name, m, x, new_c, t_bf, rows)
        del old_c, new_c, gl_c, bf_copies
        devlib.empty_cache(dev)
        if args.result_json:   # after every shape: a time-bounded run keeps what it measured
            with open(args.result_json, "w") as f:
                json.dump(rows, f, indent=1, default=str)
    return {"rows": rows}


def _sweep(dev: str, name: str, m: int, x: torch.Tensor, copies: list, t_bf: float,
           rows: list) -> None:
    """Every :func:`_configs` tile of the new kernel at ``m`` rows; prints the best three."""
    best = []
    for cfg in _configs(m):
        try:
            t = time_cfg(dev, x, copies, cfg)
        except Exception as e:  # noqa: BLE001 - a config that does not compile
            print(f"    {cfg}: {type(e).__name__}")
            continue
        best.append((t, cfg))
        rows.append(dict(shape=name, m=m, new_us=t, config=cfg))
    best.sort(key=lambda r: r[0])
    for t, cfg in best[:3]:
        print(f"    best {name} M={m}: {t:7.1f} us ({t / t_bf:5.2f} x bf16) {cfg}")


def time_cfg(dev: str, x: torch.Tensor, copies: list, cfg: dict) -> float:
    """The new kernel with an explicit config, timed like the table's."""
    from bench.kernels.sweep_gemm_fp8 import time_per_call
    from kernels.quant.w4_tc import w4k_linear

    return time_per_call(dev, [partial(w4k_linear, x, *c, config=cfg) for c in copies])


if __name__ == "__main__":
    main()
