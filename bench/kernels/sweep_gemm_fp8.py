"""FP8 decode GEMM candidates on a GPU (``python -m bench.kernels.sweep_gemm --fp8``; see there)."""

from __future__ import annotations

import itertools
import json
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from engine import device as devlib
from kernels.fp8.fp8_triton import (
    fp8_linear_fp8_dot,
    fp8_linear_small_m,
    quantize_rows_triton,
    small_m_config,
)
from kernels.fp8.reference import quantize_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
L2_DEFEAT_BYTES = 256 << 20


def time_per_call(dev: str, fns: list) -> float:
    """Device microseconds per call: ``fns`` (one per weight copy) captured in one graph,
    replayed 7 times after a warm-up; median."""
    graph_cls, event = devlib.graph_class(dev), devlib.event_class(dev)
    stream = devlib.stream_class(dev)()
    stream.wait_stream(devlib.current_stream(dev))
    with devlib.stream_context(dev, stream):
        for fn in fns:       # compile and warm up outside the capture
            fn()
    devlib.current_stream(dev).wait_stream(stream)
    devlib.synchronize(dev)
    g = graph_cls()
    with devlib.graph_context(dev, g):
        for _ in range(3):
            for fn in fns:
                fn()
    g.replay()
    devlib.synchronize(dev)
    times = []
    for _ in range(7):
        a, b = event(enable_timing=True), event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (3 * len(fns)))
    return statistics.median(times)


def _weight_copies(dev: str, n: int, k: int, g: torch.Generator):
    """Enough device copies of one random [n, k] weight (e4m3 codes, their scales, bf16) that
    cycling through them defeats the L2: ``(wqs, sws, wbs)``."""
    copies = max(2, -(-L2_DEFEAT_BYTES // (n * k)))
    w = torch.randn((n, k), generator=g).mul_(0.02)
    wq, sw = quantize_rows(w)
    return ([wq.to(dev) for _ in range(copies)], [sw.view(-1).to(dev) for _ in range(copies)],
            [w.to(torch.bfloat16).to(dev) for _ in range(copies)])


def _cases(dev: str, batch_sizes: list[int]):
    """Per Llama-3-8B shape and M: ``(name, n, k, m, x, wqs, sws, wbs)``: a bf16 input
    ``x [m, k]`` and the shape's weight copies (:func:`_weight_copies`), freed after the
    shape's last M. One seeded generator, so both sweeps draw the same operands."""
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        wqs, sws, wbs = _weight_copies(dev, n, k, g)
        for m in batch_sizes:
            x = torch.randn((m, k), generator=g).to(torch.bfloat16).to(dev)
            yield name, n, k, m, x, wqs, sws, wbs
        del wqs, sws, wbs
        devlib.empty_cache(dev)


def _write_json(rows: list, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def _quant_scaled_mm(x, wq, sw):
    xq, sx = quantize_rows_triton(x)
    return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.unsqueeze(0),
                            out_dtype=torch.bfloat16)


def _configs(m: int):
    block_m = max(16, 1 << (m - 1).bit_length())
    for bn, bk, split, stages in itertools.product((32, 64, 128), (128, 256, 512),
                                                   (1, 2, 4, 8), (2, 4)):
        yield dict(USE_DOT=True, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
                   num_warps=4, num_stages=stages)
    if m <= 2:
        for bn, bk, split in itertools.product((16, 32), (256, 512), (2, 4, 8)):
            yield dict(USE_DOT=False, SPLIT_K=split, BLOCK_M=1 << (m - 1).bit_length(),
                       BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=2)


def _cfg_name(c: dict) -> str:
    return (f"{'dot' if c['USE_DOT'] else 'sum'} n{c['BLOCK_N']} k{c['BLOCK_K']} "
            f"split{c.get('SPLIT_K', 1)} w{c['num_warps']} s{c['num_stages']}")


def sweep_fp8(dev: str, batch_sizes: list[int], result_json: str | None) -> None:
    print(f"{devlib.device_name(dev)}; us per call (weight GB/s); L2 defeated")
    cols = ("bf16 linear", "quant+scaled_mm", "small_m w8a8", "small_m w8a16")
    print(f"{'shape':8s} {'M':>4s} " + " ".join(f"{c:>20s}" for c in cols))
    rows = []
    for name, n, k, m, x, wqs, sws, wbs in _cases(dev, batch_sizes):
        ref = _quant_scaled_mm(x, wqs[0], sws[0]).float()
        try:
            out = fp8_linear_small_m(x, wqs[0], sws[0]).float()
            err = float((out - ref).norm() / ref.norm())
        except Exception as e:  # noqa: BLE001 - e.g. shared memory at M > SMALL_M_MAX
            print(f"    small_m default config at M={m}: {type(e).__name__}")
            err = float("nan")

        cand = {
            "bf16 linear": ([partial(F.linear, x, wb) for wb in wbs], 2),
            "quant+scaled_mm": ([partial(_quant_scaled_mm, x, a, b)
                                 for a, b in zip(wqs, sws)], 1),
            "small_m w8a8": ([partial(fp8_linear_small_m, x, a, b)
                              for a, b in zip(wqs, sws)], 1),
            "small_m w8a16": ([partial(fp8_linear_small_m, x, a, b, quant_x=False)
                               for a, b in zip(wqs, sws)], 1),
        }
        row = {"shape": name, "m": m, "n": n, "k": k, "small_m_err": err,
               "default_config": _cfg_name(small_m_config(m, n, k))}
        cells = []
        for col, (fns, bpe) in cand.items():
            if col.startswith("small_m") and err != err:
                cells.append("-")
                continue
            us = time_per_call(dev, fns)
            row[col] = us
            cells.append(f"{us:7.1f} ({n * k * bpe / us / 1e3:5.0f})")
        print(f"{name:8s} {m:4d} " + " ".join(f"{c:>20s}" for c in cells)
              + f"  err {err:.1e}", flush=True)
        if m in (1, 16):
            sweep = []
            for cfg in _configs(m):
                try:
                    us = time_per_call(dev, [
                        partial(fp8_linear_small_m, x, a, b, quant_x=False, config=cfg)
                        for a, b in zip(wqs, sws)])
                except Exception as e:  # noqa: BLE001 - a config that does not fit
                    print(f"    {_cfg_name(cfg)}: {type(e).__name__}")
                    continue
                sweep.append((us, _cfg_name(cfg)))
            sweep.sort()
            row["sweep"] = sweep
            print("    best: " + ", ".join(f"{c} {u:.1f}us ({n * k / u / 1e3:.0f} GB/s)"
                                          for u, c in sweep[:5]), flush=True)
        rows.append(row)
    _write_json(rows, result_json)


def _medium_configs(m: int, fp8_dot: bool):
    block_m = max(16, 1 << (m - 1).bit_length())
    bns = (64, 128) if fp8_dot else (32, 64, 128)
    bks = (128, 256) if fp8_dot else (64, 128)
    for bn, bk, split, stages, warps in itertools.product(bns, bks, (1, 2, 4), (3, 4), (4, 8)):
        yield dict(USE_DOT=True, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
                   num_warps=warps, num_stages=stages)


def sweep_fp8_medium(dev: str, batch_sizes: list[int], result_json: str | None) -> None:
    """Best launch configs of the small-M kernel's W8A16 and FP8-dot (W8A8) modes at decode
    batches past 16 rows, against bf16 ``F.linear`` and quant + ``_scaled_mm``."""
    print(f"{devlib.device_name(dev)}; us per call (weight GB/s); L2 defeated")
    rows = []
    for name, n, k, m, x, wqs, sws, wbs in _cases(dev, batch_sizes):
        ref = _quant_scaled_mm(x, wqs[0], sws[0]).float()
        row = {"shape": name, "m": m, "n": n, "k": k,
               "bf16 linear": time_per_call(dev, [partial(F.linear, x, wb) for wb in wbs]),
               "quant+scaled_mm": time_per_call(dev, [partial(_quant_scaled_mm, x, a, b)
                                                      for a, b in zip(wqs, sws)])}
        for mode, fp8_dot in (("w8a16", False), ("fp8dot", True)):
            sweep = []
            for cfg in _medium_configs(m, fp8_dot):
                fn = (partial(fp8_linear_fp8_dot, config=cfg) if fp8_dot else
                      partial(fp8_linear_small_m, quant_x=False, config=cfg))
                try:
                    out = fn(x, wqs[0], sws[0]).float()
                    err = float((out - ref).norm() / ref.norm())
                    us = time_per_call(dev, [partial(fn, x, a, b)
                                             for a, b in zip(wqs, sws)])
                except Exception as e:  # noqa: BLE001 - a config that does not fit
                    print(f"    {mode} {_cfg_name(cfg)}: {type(e).__name__}")
                    continue
                sweep.append((us, _cfg_name(cfg), err))
            sweep.sort()
            row[mode] = sweep
        cells = [f"{row[c]:6.1f} ({n * k * b / row[c] / 1e3:4.0f})"
                 for c, b in (("bf16 linear", 2), ("quant+scaled_mm", 1))]
        for mode in ("w8a16", "fp8dot"):
            if row[mode]:
                us, cfg, err = row[mode][0]
                cells.append(f"{mode} {us:6.1f} ({n * k / us / 1e3:4.0f}) {cfg} err {err:.1e}")
        print(f"{name:8s} {m:3d} " + " | ".join(cells), flush=True)
        rows.append(row)
    _write_json(rows, result_json)
