"""Micro-benchmark of the Triton attention kernels against torch (reference and SDPA).

Decode: paged split-KV decode attention, batch 1..256 x context 512..8192, Llama-3-8B
attention shape by default (32 query heads, 8 KV heads, head_dim 128, bf16). Decode is
memory-bound, so the figure of merit is achieved bandwidth: ``KV bytes / time`` where KV
bytes = ``sum(seq_lens) * Hkv * D * 2 (K and V) * itemsize`` (the bytes the kernel must
read at least; q, o, the 4-byte slot indices and the split workspaces are not counted).

Extend: prefill of uniform batches with and without a cached prefix. It is compute-bound,
so both GB/s (unique KV bytes: prefix + new tokens) and TFLOP/s (``4 * Hq * D`` per visible
query-key pair) are printed.

Baselines in the same process: ``kernels.reference`` (the torch path the CPU runs; a Python
loop over requests), ``torch.nn.functional.scaled_dot_product_attention`` over K/V already
gathered into dense ``[B, Hkv, L, D]`` tensors (a lower bound for paged attention), and for
decode also SDPA including the gather from the pool. Times are medians of
``triton.testing.do_bench`` in microseconds. ``err`` is the relative error norm of the
Triton output against the torch reference (or SDPA where the reference is skipped).

Usage (the lead, on an H200):  python -m bench.kernels.bench_kernels [--peak-gbs 4800]
Smoke check on the CPU (Triton interpreter, tiny sizes):  python -m bench.kernels.bench_kernels --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on the CPU with TRITON_INTERPRET=1 (a correctness smoke run)")
    p.add_argument("--device", default="auto", help="auto|cuda|xpu")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16|float16|float32")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--contexts", type=_ints, default=[512, 2048, 8192])
    p.add_argument("--max-kv-splits", type=int, default=16)
    p.add_argument("--min-chunk", type=int, default=None, help="choose_num_kv_splits min_chunk")
    p.add_argument("--waves", type=int, default=1, help="choose_num_kv_splits programs per SM")
    p.add_argument("--decode-block-n", type=int, default=None, help="override decode BLOCK_N")
    p.add_argument("--extend-block-m", type=int, default=None, help="override extend BLOCK_M")
    p.add_argument("--extend-block-n", type=int, default=None, help="override extend BLOCK_N")
    p.add_argument("--num-warps", type=int, default=None, help="override num_warps (both)")
    p.add_argument("--extend", default="1:0:512,1:0:2048,1:0:8192,4:0:1024,8:1024:512,1:4096:256",
                   help="extend cases bs:prefix:extend, comma separated")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-extend", action="store_true")
    p.add_argument("--no-ref", action="store_true", help="skip the slow torch reference loop")
    p.add_argument("--ref-max-batch", type=int, default=64,
                   help="skip the reference above this batch size (its Python loop is slow)")
    p.add_argument("--peak-gbs", type=float, default=None,
                   help="memory bandwidth peak in GB/s to print %% of roofline (H200: 4800)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    args = p.parse_args(argv)
    if args.smoke:   # tiny defaults; flags given explicitly still win
        p.set_defaults(device="cpu", dtype="float16", num_heads=4, num_kv_heads=2, head_dim=64,
                       batch_sizes=[1, 3], contexts=[64, 160], extend="1:0:40,2:50:17",
                       page_size=16, rep=1)   # rep=1: the interpreter is slow, time one run
        args = p.parse_args(argv)
    return args


if __name__ == "__main__" and "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # must precede the kernels' @triton.jit

import torch
import torch.nn.functional as F
import triton

from engine import device as devlib
from kernels import reference
from kernels.decode_attention import choose_num_kv_splits, decode_attention_fwd
from kernels.extend_attention import extend_attention_fwd


class Timer:
    """Median time of ``fn`` in microseconds: do_bench on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str, warmup: int, rep: int):
        self.device, self.warmup, self.rep = device, warmup, rep

    def __call__(self, fn) -> float:
        if devlib.is_accelerator(self.device):
            return 1e3 * triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep,
                                                 return_mode="median")
        fn()
        times = []
        for _ in range(1 if self.rep <= 1 else 3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _paged_pool(bs: int, lens: list[int], hkv: int, d: int, page: int, dtype, dev):
    """Pool with each request's pages in shuffled order; returns (kb, vb, r2t, rows)."""
    pages = [-(-n // page) for n in lens]
    num_pages = sum(pages)
    kb = torch.randn(((num_pages + 1) * page, hkv, d), dtype=dtype, device=dev)
    vb = torch.randn_like(kb)
    order = torch.randperm(num_pages, device=dev) + 1
    r2t = torch.zeros((bs + 1, max(lens) + 1), dtype=torch.int32, device=dev)
    off = 0
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=dev)
        r2t[b + 1, :n] = (order[off + pos // page] * page + pos % page).int()
        off += pages[b]
    rows = torch.arange(1, bs + 1, device=dev)
    return kb, vb, r2t, rows


#: relative error-norm bounds of the Triton output vs the torch baseline, per dtype
_ERR_BOUND = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
_FAILURES: list[str] = []


def _check_err(err: float, dtype, what: str) -> str:
    """Format ``err``; remember the case when it is out of bounds (main exits 1)."""
    if not err < _ERR_BOUND[dtype]:
        _FAILURES.append(f"{what}: relative error {err:.3g}")
        return f"{err:.1e}!"
    return f"{err:.1e}"


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def _print_table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(h), *(len(str(r[i])) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    print(f"\n## {title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def _decode_case(args, dev: str, dtype, timer: Timer, bs: int, ctx: int) -> list:
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    scale = d ** -0.5
    item = torch.empty((), dtype=dtype).element_size()
    lens = [ctx] * bs
    kb, vb, r2t, rows = _paged_pool(bs, lens, hkv, d, args.page_size, dtype, dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn((bs, hq, d), dtype=dtype, device=dev)
    o = torch.empty_like(q)
    kw = {} if args.min_chunk is None else {"min_chunk": args.min_chunk}
    kw["waves"] = args.waves
    splits = choose_num_kv_splits(seq_lens, hkv, args.max_kv_splits,
                                  devlib.multiprocessor_count(dev), **kw)
    logits = torch.empty((bs, hq, args.max_kv_splits, d), dtype=torch.float32, device=dev)
    lse = torch.empty((bs, hq, args.max_kv_splits), dtype=torch.float32, device=dev)

    def triton_fn():
        decode_attention_fwd(q, kb, vb, o, r2t, rows, seq_lens, scale, num_kv_splits=splits,
                             max_kv_splits=args.max_kv_splits, attn_logits=logits,
                             attn_lse=lse, block_n=args.decode_block_n,
                             num_warps=args.num_warps)

    t_tri = timer(triton_fn)
    gbs = sum(lens) * hkv * d * 2 * item / t_tri / 1e3

    slots = r2t[rows, :ctx].long()                                 # [B, L]
    kd = kb[slots].permute(0, 2, 1, 3).contiguous()                # [B, Hkv, L, D]
    vd = vb[slots].permute(0, 2, 1, 3).contiguous()
    q4 = q.unsqueeze(2)                                            # [B, Hq, 1, D]

    def sdpa():
        return F.scaled_dot_product_attention(q4, kd, vd, scale=scale, enable_gqa=True)

    def sdpa_gather():
        s = r2t[rows, :ctx].long()
        return F.scaled_dot_product_attention(q4, kb[s].transpose(1, 2), vb[s].transpose(1, 2),
                                              scale=scale, enable_gqa=True)

    t_sdpa, t_gather = timer(sdpa), timer(sdpa_gather)
    triton_fn()
    ref = torch.empty_like(q)
    if not args.no_ref and bs <= args.ref_max_batch:
        t_ref = timer(lambda: reference.decode_attention_ref(q, kb, vb, ref, r2t, rows,
                                                             seq_lens, scale))
    else:
        t_ref, ref = None, sdpa().squeeze(2)
    peak = None if args.peak_gbs is None else 100 * gbs / args.peak_gbs
    return [bs, ctx, int(splits.max()), _fmt(t_tri), _fmt(gbs, ".0f"), _fmt(peak),
            _fmt(t_ref), _fmt(t_sdpa), _fmt(t_gather), _fmt(t_sdpa / t_tri, ".2f"),
            _check_err(_rel_err(o, ref), dtype, f"decode bs={bs} ctx={ctx}")]


def bench_decode(args, dev: str, dtype, timer: Timer) -> None:
    rows = [_decode_case(args, dev, dtype, timer, bs, ctx)
            for ctx in args.contexts for bs in args.batch_sizes]
    _print_table(f"decode attention  Hq={args.num_heads} Hkv={args.num_kv_heads} "
                 f"D={args.head_dim} {str(dtype)[6:]} page={args.page_size}",
                 ["bs", "ctx", "splits", "triton_us", "GB/s", "%peak", "ref_us",
                  "sdpa_us", "sdpa+gather_us", "sdpa/triton", "err"], rows)


def _extend_case(args, dev: str, dtype, timer: Timer, bs: int, prefix: int, ext: int) -> list:
    hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    scale = d ** -0.5
    item = torch.empty((), dtype=dtype).element_size()
    lens = [prefix + ext] * bs
    kb, vb, r2t, rows = _paged_pool(bs, lens, hkv, d, args.page_size, dtype, dev)
    t = bs * ext
    q = torch.randn((t, hq, d), dtype=dtype, device=dev)
    k = torch.randn((t, hkv, d), dtype=dtype, device=dev)
    v = torch.randn((t, hkv, d), dtype=dtype, device=dev)
    o = torch.empty_like(q)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    ext_lens = torch.full((bs,), ext, dtype=torch.int32, device=dev)
    starts = torch.arange(bs, dtype=torch.int32, device=dev) * ext
    common = (kb, vb, r2t, rows, seq_lens, ext_lens, starts, scale)

    def triton_fn():
        extend_attention_fwd(q, k, v, o, *common, max_extend_len=ext,
                             block_m=args.extend_block_m, block_n=args.extend_block_n,
                             num_warps=args.num_warps)

    t_tri = timer(triton_fn)
    kv_bytes = sum(lens) * hkv * d * 2 * item
    pairs = bs * (ext * prefix + ext * (ext + 1) // 2)     # visible (query, key) pairs
    tflops = 4 * hq * d * pairs / t_tri / 1e6

    # SDPA on dense [B, H, L, D]; with a prefix the causal mask is bottom-right aligned.
    slots = r2t[rows, :prefix].long()
    kd = torch.cat([kb[slots], k.view(bs, ext, hkv, d)], 1).transpose(1, 2).contiguous()
    vd = torch.cat([vb[slots], v.view(bs, ext, hkv, d)], 1).transpose(1, 2).contiguous()
    q4 = q.view(bs, ext, hq, d).transpose(1, 2).contiguous()
    mask = None if prefix == 0 else torch.ones((ext, prefix + ext), dtype=torch.bool,
                                               device=dev).tril(prefix)

    def sdpa():
        return F.scaled_dot_product_attention(q4, kd, vd, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)

    t_sdpa = timer(sdpa)
    triton_fn()
    # The reference materialises [Hq, ext, prefix + ext] fp32 scores per request.
    ref = torch.empty_like(q)
    if not args.no_ref and hq * ext * (prefix + ext) * 4 < (2 << 30):
        t_ref = timer(lambda: reference.extend_attention_ref(q, k, v, ref, *common))
    else:
        t_ref, ref = None, sdpa().transpose(1, 2).reshape(t, hq, d)
    return [bs, prefix, ext, _fmt(t_tri), _fmt(kv_bytes / t_tri / 1e3, ".0f"),
            _fmt(tflops, ".1f"), _fmt(t_ref), _fmt(t_sdpa), _fmt(t_sdpa / t_tri, ".2f"),
            _check_err(_rel_err(o, ref), dtype, f"extend bs={bs} prefix={prefix} ext={ext}")]


def bench_extend(args, dev: str, dtype, timer: Timer) -> None:
    rows = []
    for case in args.extend.split(","):
        bs, prefix, ext = (int(x) for x in case.split(":"))
        rows.append(_extend_case(args, dev, dtype, timer, bs, prefix, ext))
    _print_table(f"extend attention  Hq={args.num_heads} Hkv={args.num_kv_heads} "
                 f"D={args.head_dim} {str(dtype)[6:]} page={args.page_size}",
                 ["bs", "prefix", "extend", "triton_us", "GB/s", "TFLOP/s", "ref_us",
                  "sdpa_us", "sdpa/triton", "err"], rows)


def main(argv=None) -> None:
    """Run the benchmark; exits 1 when a Triton output disagrees with torch."""
    args = parse_args(argv)
    _FAILURES.clear()
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke needs TRITON_INTERPRET=1 before the kernels are imported; "
                         "run it as `python -m bench.kernels.bench_kernels --smoke`")
    dev = devlib.resolve_device(args.device)
    if not args.smoke and not devlib.is_accelerator(dev):
        raise SystemExit("no CUDA/XPU device: use --smoke for a CPU interpreter run")
    dtype = devlib.resolve_dtype(args.dtype, dev)
    torch.manual_seed(0)
    timer = Timer(dev, args.warmup, args.rep)
    print(f"device: {devlib.device_name(dev)} ({dev}), SMs/cores: "
          f"{devlib.multiprocessor_count(dev)}, torch {torch.__version__}, "
          f"triton {triton.__version__}{' [interpreter smoke run]' if args.smoke else ''}")
    with torch.inference_mode():
        if not args.skip_decode:
            bench_decode(args, dev, dtype, timer)
        if not args.skip_extend:
            bench_extend(args, dev, dtype, timer)
    if _FAILURES:
        print("\nMISMATCH vs torch:\n  " + "\n  ".join(_FAILURES))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
