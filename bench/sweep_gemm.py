"""Decode-shaped GEMMs: which weight layout and BLAS library read the weights fastest.

``python -m bench.sweep_gemm [--batch-sizes 1,64,256]`` times ``y = x W^T`` for the
Llama-3-8B projections (qkv, o, gate_up, down, LM head) in bf16 four ways: ``F.linear`` on
``W [N, K]`` (ferry's layout) and ``x @ W_t`` on a pre-transposed ``W_t [K, N]``, each with
torch's default BLAS and with cuBLASLt preferred. Median device time per call
(``triton.testing.do_bench``, which flushes the L2 between calls) and the weight bytes per
second, the figure that bounds decode.
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
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 64, 256])
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    args = p.parse_args(argv)
    dev = devlib.resolve_device("auto")
    if not devlib.is_accelerator(dev):
        raise SystemExit("sweep_gemm needs a GPU")
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
