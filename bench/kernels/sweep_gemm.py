"""Decode-shaped GEMMs: which weight layout and BLAS library read the weights fastest.

``python -m bench.kernels.sweep_gemm [--batch-sizes 1,64,256]`` times ``y = x W^T`` for the
Llama-3-8B projections (qkv, o, gate_up, down, LM head) in bf16 four ways: ``F.linear`` on
``W [N, K]`` (ferry's layout) and ``x @ W_t`` on a pre-transposed ``W_t [K, N]``, each with
torch's default BLAS and with cuBLASLt preferred. Median device time per call
(``triton.testing.do_bench``, which flushes the L2 between calls) and the weight bytes per
second, the figure that bounds decode.

``python -m bench.kernels.sweep_gemm --fp8 [--result-json F]`` times the FP8 (e4m3, per-channel)
candidates for the same shapes at decode M: bf16 ``F.linear`` (the baseline),
``quantize_rows_triton`` + ``torch._scaled_mm`` (cuBLASLt), and ferry's small-M Triton kernel
(``fp8_linear_small_m``, W8A8 and W8A16) with its default launch config, plus a sweep of
its launch configs (W8A16, the layers' mode at M <= 16) at M = 1 and 16 (default M: 1, 4,
16, 32, 64). ``--fp8-medium`` sweeps the launch configs of the two small-M kernel modes
that could replace ``_scaled_mm`` at M = 32 and 64 (default): W8A16 (weights upcast in
registers) and W8A8 on the FP8 tensor cores (``fp8_linear_fp8_dot``). Each figure is one call's device time from a CUDA graph of calls that cycle through enough weight copies (>= 256 MB) that no call finds its weights
in the L2; median of 7 replays. The bytes are the weight bytes of the call's dtype.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from engine import device as devlib

SHAPES = {  # name: (N, K), Llama-3-8B
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="sweep_gemm", description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=_ints, default=None,
                   help="M values (default 1,8,64,256; with --fp8 1,4,16,32,64)")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    p.add_argument("--fp8", action="store_true", help="the FP8 candidates (see above)")
    p.add_argument("--fp8-medium", action="store_true",
                   help="the small-M kernel's configs at M = 32, 64 (see above)")
    p.add_argument("--result-json", default=None, help="--fp8: write every timing here")
    args = p.parse_args(argv)
    dev = devlib.resolve_device("auto")
    if not devlib.is_accelerator(dev):
        raise SystemExit("sweep_gemm needs a GPU")
    if args.fp8_medium:
        from bench.kernels.sweep_gemm_fp8 import sweep_fp8_medium
        sweep_fp8_medium(dev, args.batch_sizes or [32, 64], args.result_json)
        return
    if args.fp8:
        from bench.kernels.sweep_gemm_fp8 import sweep_fp8
        sweep_fp8(dev, args.batch_sizes or [1, 4, 16, 32, 64], args.result_json)
        return
    args.batch_sizes = args.batch_sizes or [1, 8, 64, 256]
    dt = torch.bfloat16
    libs = ["default", "cublaslt"]
    print(f"{devlib.device_name(dev)}; us per call and weight GB/s")
    print(f"{'shape':8s} {'M':>4s} " + " ".join(f"{v:>22s}" for v in
          ("linear/default", "linear/cublaslt", "x@Wt/default", "x@Wt/cublaslt")))
    for name, (n, k) in SHAPES.items():
        w = torch.randn((n, k), dtype=dt, device=dev) * 0.02
        wt = w.t().contiguous()
        nbytes = n * k * 2
        for m in args.batch_sizes:
            x = torch.randn((m, k), dtype=dt, device=dev)
            ref = F.linear(x, w).float()
            cells = []
            for layout in ("linear", "x@Wt"):
                for lib in libs:
                    devlib.set_blas_library(dev, lib)
                    if layout == "linear":
                        def fn(x=x, w=w):
                            return F.linear(x, w)
                    else:
                        def fn(x=x, wt=wt):
                            return x @ wt
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    us = 1e3 * triton.testing.do_bench(fn, rep=args.rep, return_mode="median")
                    flag = "!" if err > 1e-2 else ""
                    cells.append(f"{us:8.1f} {nbytes / us / 1e3:6.0f}GB/s{flag}")
            devlib.set_blas_library(dev, "default")
            print(f"{name:8s} {m:4d} " + " ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
