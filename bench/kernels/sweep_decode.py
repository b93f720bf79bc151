"""Decode attention launch-configuration sweep, timed the way the decode step runs it.

``python -m bench.kernels.sweep_decode [--batch-sizes 1,8,32] [--contexts 512,2048]`` captures one
device graph of ``--layers`` decode-attention calls (each on its own layer's K/V buffers, so
the KV is not served from L2, as in a real step where the weights of a layer flush it) for
every configuration (``min_chunk`` of the split rule, ``BLOCK_N``, ``num_warps``,
``num_stages``), replays it, and prints the median time per call in microseconds (device
events, after warm-up) with the achieved KV bandwidth. Graph replay removes the Python launch
cost that ``triton.testing.do_bench`` would include for kernels of a few microseconds.

The output of every configuration is checked against the torch reference of the first
layer, so a fast but wrong configuration is flagged (``err!``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from engine import device as devlib
from kernels import reference
from kernels.decode_attention import choose_num_kv_splits, decode_attention_fwd


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _case(dev: str, bs: int, ctx: int, layers: int, hq: int, hkv: int, d: int, dtype,
          configs: list[tuple], max_splits: int, reps: int) -> list[tuple]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    dgen = torch.Generator(device=dev).manual_seed(0)
    n = bs * ctx
    pools = [(torch.randn((n + 1, hkv, d), generator=dgen, device=dev, dtype=dtype),
              torch.randn((n + 1, hkv, d), generator=dgen, device=dev, dtype=dtype))
             for _ in range(layers)]
    perm = torch.randperm(n, generator=gen) + 1
    r2t = torch.zeros((bs + 1, ctx), dtype=torch.int32)
    r2t[1:] = perm.view(bs, ctx).int()
    r2t = r2t.to(dev)
    rows = torch.arange(1, bs + 1, device=dev)
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((bs, hq, d), generator=gen).to(dev, dtype)
    o = torch.empty_like(q)
    logits = torch.empty((bs, hq, max_splits, d), dtype=torch.float32, device=dev)
    lse = torch.empty((bs, hq, max_splits), dtype=torch.float32, device=dev)
    ref = torch.empty_like(q)
    reference.decode_attention_ref(q, pools[0][0], pools[0][1], ref, r2t, rows, seq_lens, d ** -0.5)
    sms = devlib.multiprocessor_count(dev)
    kv_bytes = n * hkv * d * 2 * q.element_size()
    out = []
    gcls, ev = devlib.graph_class(dev), devlib.event_class(dev)
    for min_chunk, block_n, warps, stages, waves in configs:
        splits = choose_num_kv_splits(seq_lens, hkv, max_splits, sms, min_chunk=min_chunk,
                                      waves=waves)

        def run(layer_list, splits=splits, block_n=block_n, warps=warps, stages=stages):
            for kb, vb in layer_list:
                decode_attention_fwd(q, kb, vb, o, r2t, rows, seq_lens, d ** -0.5,
                                     num_kv_splits=splits, max_kv_splits=max_splits,
                                     attn_logits=logits, attn_lse=lse, block_n=block_n,
                                     num_warps=warps, num_stages=stages)

        run(pools[:1])
        err = ((o.double() - ref.double()).norm() / ref.double().norm()).item()
        run(pools)
        devlib.synchronize(dev)
        g = gcls()
        with devlib.graph_context(dev, g):
            run(pools)
        for _ in range(3):
            g.replay()
        times = []
        for _ in range(reps):
            a, b = ev(enable_timing=True), ev(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / layers)
        us = statistics.median(times)
        out.append((bs, ctx, int(splits.max()), min_chunk, block_n, warps, stages, waves, us,
                    kv_bytes / us / 1e3, err))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="sweep_decode", description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32])
    p.add_argument("--contexts", type=_ints, default=[512, 2048])
    p.add_argument("--min-chunks", type=_ints, default=[32, 64, 128, 256])
    p.add_argument("--block-ns", type=_ints, default=[16, 32, 64])
    p.add_argument("--warps", type=_ints, default=[2, 4])
    p.add_argument("--stages", type=_ints, default=[1, 2])
    p.add_argument("--waves", type=_ints, default=[1], help="choose_num_kv_splits waves")
    p.add_argument("--max-kv-splits", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--top", type=int, default=6, help="best configurations printed per shape")
    args = p.parse_args(argv)
    dev = devlib.resolve_device("auto")
    if devlib.graph_class(dev) is None:
        raise SystemExit("sweep_decode needs a device with graphs (cuda or xpu)")
    configs = list(itertools.product(args.min_chunks, args.block_ns, args.warps, args.stages,
                                       args.waves))
    print(f"{devlib.device_name(dev)}: {len(configs)} configurations, {args.layers} layers per "
          f"graph, median of {args.reps} replays; us per call")
    for bs, ctx in itertools.product(args.batch_sizes, args.contexts):
        rows = _case(dev, bs, ctx, args.layers, args.num_heads, args.num_kv_heads,
                     args.head_dim, torch.bfloat16, configs, args.max_kv_splits, args.reps)
        old = next((r for r in rows if r[3:8] == (128, 64, 4, 2, 1)), None)
        rows.sort(key=lambda r: r[8])
        print(f"\n## bs={bs} ctx={ctx}" + (f"  previous default (128,64,4,2,1 wave): "
                                           f"{old[8]:.2f} us, {old[2]} splits" if old else ""))
        print("splits min_chunk block_n warps stages waves      us    GB/s  err")
        for r in rows[:args.top]:
            flag = "!" if not r[10] < 3e-2 else ""
            print(f"{r[2]:6d} {r[3]:9d} {r[4]:7d} {r[5]:5d} {r[6]:6d} {r[7]:5d} {r[8]:7.2f} "
                  f"{r[9]:7.0f}  {r[10]:.1e}{flag}")

if __name__ == "__main__":
    main()
