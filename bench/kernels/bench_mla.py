"""MLA decode kernel microbenchmark (``kernels/mla/decode.py``), timed as a decode step runs it.

``python -m bench.kernels.bench_mla [--batch-sizes 1,64] [--contexts 4096]`` builds one
latent pool per layer (``--layers`` of them, DeepSeek-V3's shape by default: 128 heads,
``kv_lora_rank`` 512, rope 64, bf16, pages shuffled), captures one device graph of
``--layers`` decode calls (each on its own layer's pool, so the cache is not served from
L2, as in a real step), replays it after warm-up and prints the median time per call in
microseconds (device events) with the achieved latent-read bandwidth and its fraction of
``--peak-gbs`` (H200: 4800 GB/s).

Roofline: decode is a read of the latent cache, ``B x context x (R + P) x itemsize`` bytes
per layer (1152 bytes a token in bf16, 576 with ``--kv-dtype fp8_e4m3``: the pools hold
e4m3, the kernel's ``KV_FP8`` path; q, o, the slot indices and the split workspaces are not
counted). The output of layer 0 is checked against ``kernels.mla.reference`` (``err``).

``--configs default,legacy,64x64x4x2v2``: the launch configurations to time per shape
(``default``: the kernel's table, ``kernels/mla/decode_config.py``; ``legacy``: the pre-table
``16x32x4x2``; a tag ``BLOCK_HxBLOCK_NxWARPSxSTAGES[vSPLIT_V]``); each row also gives the
achieved TFLOP/s of the useful dots (``B x context x H x 2 x (2R + P)``).

``--sweep``: the table's sweep (``bench/h200_run.sh mla-sweep``, < 150 s on an H200): for
128 heads (bf16 and e4m3 latents) and 16 heads (bf16 and e4m3), bs 1 and 64, contexts 4k
and 32k, a handful of candidate configurations each (:data:`SWEEP_CANDIDATES`); prints every
row, the best per shape, the pick per (head bucket, kv kind) (the least geometric-mean
slowdown against each shape's best) and one line, ``MLA_DECODE_TAGS = {...}``, to paste
into ``kernels/mla/decode_config.py`` (the 128-head picks serve the 64-head bucket too; the
32-head bucket keeps its entries).

``--smoke``: tiny sizes on the CPU in Triton's interpreter (a correctness run, no graphs).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

#: a sweep row with a larger relative error than this (bf16 and FP8 rows are ~5e-3) is wrong
MAX_ERR = 3e-2
#: (heads, kv dtype) -> the tags the sweep times (the table's default is added to each)
SWEEP_CANDIDATES = {
    (128, "auto"): ["legacy", "64x64x4x2v2", "64x32x4x3v2", "64x32x4x2v2", "64x32x8x2"],
    (128, "fp8_e4m3"): ["legacy", "64x64x4x2v2", "64x32x4x3v2", "64x32x8x2", "64x64x8x2",
                        "16x32x8x2"],
    (16, "auto"): ["legacy", "16x64x8x2", "16x32x8x2", "16x64x4x2", "16x64x8x3"],
    (16, "fp8_e4m3"): ["legacy", "16x32x8x2", "16x64x8x2"],
}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, CPU interpreter")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                   help="the latent pools' dtype (auto: --dtype)")
    p.add_argument("--num-heads", type=int, default=128)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--batch-sizes", type=_ints, default=None, help="default 1,64 (1,3 smoke)")
    p.add_argument("--contexts", type=_ints, default=None,
                   help="default 4096; 4096,32768 with --sweep")
    p.add_argument("--layers", type=int, default=8, help="pools per graph (L2 flush)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-kv-splits", type=int, default=64,
                   help="the MLA backend's default")
    p.add_argument("--waves", type=int, default=1)
    p.add_argument("--configs", type=lambda x: [c for c in x.split(",") if c],
                   default=["default"], help="launch configurations to time (module doc)")
    p.add_argument("--sweep", action="store_true", help="the table's sweep (module doc)")
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--peak-gbs", type=float, default=4800.0)
    ns = p.parse_args(argv)
    ns.contexts = ns.contexts or ([4096, 32768] if ns.sweep else [4096])
    if ns.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        ns.device, ns.dtype, ns.num_heads, ns.kv_lora_rank, ns.rope_dim = \
            "cpu", "float32", 20, 32, 16
        ns.contexts, ns.layers, ns.reps = [70], 2, 2
    ns.batch_sizes = ns.batch_sizes or ([1, 3] if ns.smoke else [1, 64])
    return ns


def _pools(torch, dev, bs, ctx, layers, width, page, dtype, gen):
    """``layers`` latent pools and one shuffled page table for ``bs`` requests of ``ctx``."""
    pages = -(-ctx // page)
    n_pages = bs * pages
    slots_total = (n_pages + 1) * page
    dgen = torch.Generator(device=dev).manual_seed(1)      # drawn on the device: GBs at 32k
    pools = [torch.randn((slots_total, 1, width), generator=dgen, device=dev, dtype=dtype)
             for _ in range(layers)]
    perm = (torch.randperm(n_pages, generator=gen) + 1).view(bs, pages)
    pos = torch.arange(ctx)
    r2t = torch.zeros((bs + 1, ctx), dtype=torch.int32)
    r2t[1:] = (perm[:, pos // page] * page + pos % page).int()
    return pools, r2t.to(dev)


def bench_case(ns, bs: int, ctx: int, configs: list[str] | None = None) -> list[dict]:
    """One row per launch configuration (``configs``, default ``ns.configs``) of the shape
    ``bs`` x ``ctx`` x ``ns.num_heads`` over ``ns.kv_dtype`` pools."""
    import torch

    from engine import device as devlib
    from kernels.mla.reference import mla_attention_ref

    dev = devlib.resolve_device(ns.device)
    dtype = getattr(torch, ns.dtype)
    h, r, p = ns.num_heads, ns.kv_lora_rank, ns.rope_dim
    gen = torch.Generator().manual_seed(0)
    pools, r2t = _pools(torch, dev, bs, ctx, ns.layers, r + p, ns.page_size, dtype, gen)
    if ns.kv_dtype == "fp8_e4m3":
        pools = [pool.to(torch.float8_e4m3fn) for pool in pools]
    rows = torch.arange(1, bs + 1, device=dev)
    seq = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    q_lat = (torch.randn((bs, h, r), generator=gen) * 0.05).to(dev, dtype)
    q_pe = (torch.randn((bs, h, p), generator=gen) * 0.05).to(dev, dtype)
    scale = 192 ** -0.5
    ref = mla_attention_ref(torch.cat([q_lat, q_pe], -1), pools[0], r2t, rows.tolist(),
                            [ctx] * bs, [1] * bs, scale, r)
    kv_bytes = bs * ctx * (r + p) * pools[0].element_size()
    flops = 2 * bs * ctx * h * (2 * r + p)
    out = []
    from triton.runtime import OutOfResources

    for tag in configs or ns.configs:
        try:
            c = _time_config(ns, devlib, dev, tag, (q_lat, q_pe, pools, r2t, rows, seq, scale),
                             ref)
        except OutOfResources as e:   # a candidate over the device's shared memory: no row
            print(f"{tag}: {e}")
            continue
        gbs = kv_bytes / c["us"] / 1e3
        out.append({"bs": bs, "ctx": ctx, "heads": h, "config": c["tag"],
                    "splits": c["splits"], "us": c["us"], "gbs": gbs,
                    "roofline": gbs / ns.peak_gbs, "tflops": flops / c["us"] / 1e6,
                    "err": c["err"]})
    del pools
    return out


def _time_config(ns, devlib, dev, tag: str, case, ref) -> dict:
    """``{"tag", "splits", "us", "err"}`` of one configuration on one shape's pools."""
    import torch

    from kernels.mla.decode import (
        choose_mla_splits,
        mla_decode_fwd,
        mla_decode_workspaces,
        mla_split_cap,
    )
    from kernels.mla.decode_config import MLADecodeConfig, mla_decode_config

    q_lat, q_pe, pools, r2t, rows, seq, scale = case
    bs, h, r = q_lat.shape
    fp8 = pools[0].element_size() == 1
    cfg = mla_decode_config(h, fp8, q_lat.dtype) if tag == "default" \
        else MLADecodeConfig.parse(tag)
    sms = devlib.multiprocessor_count(dev) if devlib.is_accelerator(dev) else 8
    cap = mla_split_cap(bs, h, sms, ns.waves, ns.max_kv_splits, config=cfg)
    splits = choose_mla_splits(seq, h, cap, sms, waves=ns.waves, config=cfg)
    logits, lse = mla_decode_workspaces(bs, h, cap, r, dev)
    o = torch.empty_like(q_lat)

    def run(layer_pools):
        for pool in layer_pools:
            mla_decode_fwd(q_lat, q_pe, pool, o, r2t, rows, seq, scale, splits, cap, logits,
                           lse, config=cfg, block_n=ns.block_n, num_warps=ns.num_warps)

    run(pools[:1])
    err = ((o.double() - ref.double()).norm() / ref.double().norm()).item()
    if devlib.is_accelerator(dev):
        per_call = _graph_time(devlib, dev, run, pools, ns.reps) / len(pools)
    else:
        t0 = time.perf_counter()
        run(pools)
        per_call = (time.perf_counter() - t0) * 1e6 / len(pools)
    name = f"{cfg.tag}*" if tag == "default" else cfg.tag
    return {"tag": name, "splits": cap, "us": per_call, "err": err}


def _graph_time(devlib, dev, run, pools, reps: int) -> float:
    """Median microseconds of one replay of a graph of ``run(pools)`` (device events)."""
    run(pools)
    devlib.synchronize(dev)
    g = devlib.graph_class(dev)()
    with devlib.graph_context(dev, g):
        run(pools)
    for _ in range(5):
        g.replay()
    ev, times = devlib.event_class(dev), []
    for _ in range(reps):
        a, b = ev(enable_timing=True), ev(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


HEADER = (f"{'bs':>4} {'ctx':>6} {'config':>13} {'splits':>6} {'us/call':>9} {'GB/s':>8} "
          f"{'roof':>6} {'TFLOP/s':>8} {'err':>9}")


def _row(c: dict) -> str:
    return (f"{c['bs']:>4} {c['ctx']:>6} {c['config']:>13} {c['splits']:>6} {c['us']:>9.1f} "
            f"{c['gbs']:>8.0f} {c['roofline']:>6.2f} {c['tflops']:>8.1f} {c['err']:>9.2e}")


def sweep(ns) -> dict:
    """The table's sweep (module docstring): prints the rows and the picks; returns
    ``{(bucket, kind): tag}``."""
    import torch

    from kernels.mla.decode_config import (
        MLADecodeConfig,
        head_bucket,
        kv_kind,
        mla_decode_config,
        table_line,
    )

    picks = {}
    for (heads, kv), tags in SWEEP_CANDIDATES.items():
        ns.num_heads, ns.kv_dtype = heads, kv
        default = mla_decode_config(heads, kv != "auto", getattr(torch, ns.dtype))
        tags = [t for t in tags if MLADecodeConfig.parse(t) != default]
        print(f"## {heads} heads, latent {ns.dtype if kv == 'auto' else kv}  "
              "(* = the table's current default)")
        print(HEADER)
        slow: dict[str, list[float]] = {}
        for bs in ns.batch_sizes:
            for ctx in ns.contexts:
                # enough layers that the pools outgrow L2 (50 MB on an H200), at most 16
                if not ns.smoke:
                    ns.layers = max(2, min(16, -(-128 * 2**20 // (bs * ctx * 1152))))
                rows = bench_case(ns, bs, ctx, ["default"] + tags)
                if not rows:
                    continue
                # a config whose output is off (err: relative to the reference) never wins
                best = min(rows, key=lambda c: c["us"] if c["err"] < MAX_ERR else math.inf)
                for c in rows:
                    print(_row(c) + ("" if c["err"] < MAX_ERR else "  WRONG"))
                    ratio = c["us"] / best["us"] if c["err"] < MAX_ERR else math.inf
                    slow.setdefault(c["config"].rstrip("*"), []).append(ratio)
                print(f"best bs{bs} ctx{ctx}: {best['config']} {best['us']:.1f} us "
                      f"({best['tflops']:.0f} TFLOP/s, {best['roofline']:.2f} of the read)")
        geo = {t: math.exp(sum(map(math.log, v)) / len(v)) for t, v in slow.items()}
        pick = min(geo, key=geo.get)
        print("slowdown vs each shape's best (geometric mean): "
              + ", ".join(f"{t} {g:.2f}" for t, g in sorted(geo.items(), key=lambda x: x[1])))
        key = (head_bucket(heads), kv_kind(kv != "auto"))
        picks[key] = pick
        if key[0] is None:
            picks[(64, key[1])] = pick
        # after every block, so that a sweep cut short still leaves its line
        print("MLA_DECODE_TAGS = " + table_line(picks), flush=True)
    return picks


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.sweep:
        sweep(ns)
        return 0
    kv = ns.dtype if ns.kv_dtype == "auto" else ns.kv_dtype
    print(f"MLA decode: {ns.num_heads} heads, R {ns.kv_lora_rank}, rope {ns.rope_dim}, "
          f"{ns.dtype}, latent {kv}, {ns.layers} layers per graph, peak {ns.peak_gbs:.0f} GB/s")
    print(HEADER)
    for bs in ns.batch_sizes:
        for ctx in ns.contexts:
            for c in bench_case(ns, bs, ctx):
                print(_row(c))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
