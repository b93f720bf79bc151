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

``--smoke``: tiny sizes on the CPU in Triton's interpreter (a correctness run, no graphs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


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
    p.add_argument("--batch-sizes", type=_ints, default=[1, 64])
    p.add_argument("--contexts", type=_ints, default=[4096])
    p.add_argument("--layers", type=int, default=8, help="pools per graph (L2 flush)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-kv-splits", type=int, default=32)
    p.add_argument("--waves", type=int, default=1)
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--peak-gbs", type=float, default=4800.0)
    ns = p.parse_args(argv)
    if ns.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        ns.device, ns.dtype, ns.num_heads, ns.kv_lora_rank, ns.rope_dim = \
            "cpu", "float32", 20, 32, 16
        ns.batch_sizes, ns.contexts, ns.layers, ns.reps = [1, 3], [70], 2, 2
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


def bench_case(ns, bs: int, ctx: int) -> dict:
    import torch

    from engine import device as devlib
    from kernels.mla.decode import (
        choose_mla_splits,
        mla_decode_fwd,
        mla_decode_workspaces,
        mla_split_cap,
    )
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
    sms = devlib.multiprocessor_count(dev) if devlib.is_accelerator(dev) else 8
    cap = mla_split_cap(bs, h, sms, ns.waves, ns.max_kv_splits)
    splits = choose_mla_splits(seq, h, cap, sms, waves=ns.waves)
    logits, lse = mla_decode_workspaces(bs, h, cap, r, dev)
    o = torch.empty_like(q_lat)
    scale = 192 ** -0.5

    def run(layer_pools):
        for pool in layer_pools:
            mla_decode_fwd(q_lat, q_pe, pool, o, r2t, rows, seq, scale, splits, cap, logits,
                           lse, block_n=ns.block_n, num_warps=ns.num_warps)

    run(pools[:1])
    ref = mla_attention_ref(torch.cat([q_lat, q_pe], -1), pools[0], r2t, rows.tolist(),
                            [ctx] * bs, [1] * bs, scale, r)
    err = ((o.double() - ref.double()).norm() / ref.double().norm()).item()
    if devlib.is_accelerator(dev):
        per_call = _graph_time(devlib, dev, run, pools, ns.reps) / ns.layers
    else:
        t0 = time.perf_counter()
        run(pools)
        per_call = (time.perf_counter() - t0) * 1e6 / ns.layers
    kv_bytes = bs * ctx * (r + p) * pools[0].element_size()
    gbs = kv_bytes / per_call / 1e3
    return {"bs": bs, "ctx": ctx, "heads": h, "splits": cap, "us": per_call, "gbs": gbs,
            "roofline": gbs / ns.peak_gbs, "err": err}


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


def main(argv=None) -> int:
    ns = parse_args(argv)
    kv = ns.dtype if ns.kv_dtype == "auto" else ns.kv_dtype
    print(f"MLA decode: {ns.num_heads} heads, R {ns.kv_lora_rank}, rope {ns.rope_dim}, "
          f"{ns.dtype}, latent {kv}, {ns.layers} layers per graph, peak {ns.peak_gbs:.0f} GB/s")
    print(f"{'bs':>4} {'ctx':>6} {'splits':>6} {'us/call':>9} {'GB/s':>8} {'roof':>6} {'err':>9}")
    for bs in ns.batch_sizes:
        for ctx in ns.contexts:
            c = bench_case(ns, bs, ctx)
            print(f"{c['bs']:>4} {c['ctx']:>6} {c['splits']:>6} {c['us']:>9.1f} "
                  f"{c['gbs']:>8.0f} {c['roofline']:>6.2f} {c['err']:>9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
