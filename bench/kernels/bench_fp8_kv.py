"""Decode attention alone with a bf16 and an FP8 (e4m3) KV cache, timed as a decode step runs it.

``python -m bench.kernels.bench_fp8_kv [--batch-sizes 1,64] [--contexts 2048,8192]`` builds,
per (batch size, context), a Llama-3-8B-shaped layer stack (32 query heads, 8 KV heads, head
dim 128; as many layers as fit ``--pool-gb``, at most ``--layers``, each with its own K/V so
the KV is read from HBM, not L2), captures one device graph of one decode-attention call per
layer for each KV dtype (and each FP8 launch configuration of ``--fp8-configs``), replays it
after warm-up and prints the median time per call (device events) with the KV bytes read,
the achieved bandwidth and the ratio bf16 / FP8. Slots are a random permutation (pages of
one token), as a long-running server's pool ends up.

Every row is checked against the torch reference over the dequantised pool (``err``); FP8
rows use per-tensor scales != 1 (``k_scale``, ``v_scale``), as a calibrated checkpoint would.
``--result-json`` writes all rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from engine import device as devlib
from kernels import reference
from kernels.decode_attention import choose_num_kv_splits, decode_attention_fwd

K_SCALE, V_SCALE = 0.02, 0.015


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _configs(s: str) -> list[tuple]:
    """``"64x4x2,128x4x3"`` -> [(64, 4, 2), (128, 4, 3)] (block_n x warps x stages); a
    ``default`` entry is (None, None, None): the wrapper's own choice."""
    out = []
    for c in s.split(","):
        out.append((None, None, None) if c == "default" else tuple(int(x) for x in c.split("x")))
    return out


def _time_graph(dev: str, run, layers: int, reps: int) -> float:
    run()
    devlib.synchronize(dev)
    g = devlib.graph_class(dev)()
    with devlib.graph_context(dev, g):
        run()
    for _ in range(5):
        g.replay()
    ev = devlib.event_class(dev)
    times = []
    for _ in range(reps):
        a, b = ev(enable_timing=True), ev(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / layers)
    return statistics.median(times)


def _case(dev: str, bs: int, ctx: int, args, fp8_configs: list[tuple]) -> list[dict]:
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    n = bs * ctx
    per_layer_bf16 = 2 * (n + 1) * hkv * d * 2
    layers = max(2, min(args.layers, int(args.pool_gb * 2 ** 30 // per_layer_bf16)))
    gen = torch.Generator(device="cpu").manual_seed(0)
    dgen = torch.Generator(device=dev).manual_seed(0)
    pools16 = [tuple(torch.randn((n + 1, hkv, d), generator=dgen, device=dev,
                                 dtype=torch.bfloat16) for _ in range(2))
               for _ in range(layers)]
    r2t = torch.zeros((bs + 1, ctx), dtype=torch.int32)
    r2t[1:] = (torch.randperm(n, generator=gen) + 1).view(bs, ctx).int()
    r2t = r2t.to(dev)
    rows = torch.arange(1, bs + 1, device=dev)
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn((bs, hq, d), generator=gen).to(dev, torch.bfloat16)
    o = torch.empty_like(q)
    max_splits = args.max_kv_splits
    logits = torch.empty((bs, hq, max_splits, d), dtype=torch.float32, device=dev)
    lse = torch.empty((bs, hq, max_splits), dtype=torch.float32, device=dev)
    splits = choose_num_kv_splits(seq_lens, hkv, max_splits, devlib.multiprocessor_count(dev))
    kv_bytes16 = n * hkv * d * 2 * 2
    out = []

    def measure(pools, kind, kb_bytes, cfg, scales):
        block_n, warps, stages = cfg

        def run():
            for kb, vb in pools:
                decode_attention_fwd(q, kb, vb, o, r2t, rows, seq_lens, d ** -0.5,
                                     num_kv_splits=splits, max_kv_splits=max_splits,
                                     attn_logits=logits, attn_lse=lse, block_n=block_n,
                                     num_warps=warps, num_stages=stages, **scales)

        ref = torch.empty(q.shape, dtype=torch.float32, device=dev)
        kb, vb = pools[0]
        ks, vs = scales.get("k_scale", 1.0), scales.get("v_scale", 1.0)
        reference.decode_attention_ref(q.float(), kb.float() * ks, vb.float() * vs, ref, r2t,
                                       rows, seq_lens, d ** -0.5)
        decode_attention_fwd(q, kb, vb, o, r2t, rows, seq_lens, d ** -0.5,
                             num_kv_splits=splits, max_kv_splits=max_splits, attn_logits=logits,
                             attn_lse=lse, block_n=block_n, num_warps=warps,
                             num_stages=stages, **scales)
        err = ((o.double() - ref.double()).norm() / ref.double().norm()).item()
        us = _time_graph(dev, run, layers, args.reps)
        out.append({"bs": bs, "ctx": ctx, "kv": kind, "block_n": block_n, "num_warps": warps,
                    "num_stages": stages, "splits": int(splits.max()), "layers": layers,
                    "us": us, "kv_bytes": kb_bytes, "gbs": kb_bytes / us / 1e3, "err": err})

    measure(pools16, "bf16", kv_bytes16, (None, None, None), {})
    # the bf16 values are the real keys/values; the pool holds them / scale (inside +-448)
    pools8 = [tuple((x.float() / s).clamp(-440, 440).to(torch.float8_e4m3fn)
                    for x, s in ((kb, K_SCALE), (vb, V_SCALE))) for kb, vb in pools16]
    del pools16
    for cfg in fp8_configs:
        measure(pools8, "fp8_e4m3", kv_bytes16 // 2, cfg,
                {"k_scale": K_SCALE, "v_scale": V_SCALE})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench_fp8_kv", description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=_ints, default=[1, 64])
    p.add_argument("--contexts", type=_ints, default=[2048, 8192])
    p.add_argument("--fp8-configs", type=_configs,
                   default=_configs("default,32x4x2,64x4x3,64x4x4,128x4x2,128x4x3,128x8x2"),
                   help="FP8 launch configurations BLOCK_NxWARPSxSTAGES ('default': the "
                        "wrapper's); bf16 runs its default")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--pool-gb", type=float, default=24.0, help="bf16 KV bytes per case, at most")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--max-kv-splits", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--peak-gbs", type=float, default=4800.0, help="HBM bandwidth (H200: 4800)")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    dev = devlib.resolve_device("auto")
    if devlib.graph_class(dev) is None:
        raise SystemExit("bench_fp8_kv needs a device with graphs (cuda or xpu)")
    print(f"{devlib.device_name(dev)}: decode attention per layer call, median of {args.reps} "
          f"graph replays (device events); Hq={args.num_heads} Hkv={args.num_kv_heads} "
          f"D={args.head_dim}, k_scale={K_SCALE} v_scale={V_SCALE}")
    rows = []
    for bs, ctx in itertools.product(args.batch_sizes, args.contexts):
        case = _case(dev, bs, ctx, args, args.fp8_configs)
        rows += case
        base = case[0]["us"]
        print(f"\n## bs={bs} ctx={ctx} ({case[0]['layers']} layers, {case[0]['splits']} splits)")
        print("kv        block_n warps stages      us    GB/s  of-peak  bf16/this  err")
        for r in case:
            cfg = [("-" if x is None else str(x)) for x in (r["block_n"], r["num_warps"],
                                                            r["num_stages"])]
            flag = "" if r["err"] < 3e-2 else "!"
            print(f"{r['kv']:9s} {cfg[0]:>7s} {cfg[1]:>5s} {cfg[2]:>6s} {r['us']:7.2f} "
                  f"{r['gbs']:7.0f} {r['gbs'] / args.peak_gbs:8.2f} {base / r['us']:10.2f}  "
                  f"{r['err']:.1e}{flag}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
