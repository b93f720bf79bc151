"""The CPU's knobs: native bf16, oneDNN's prepacked linear weights, intra-op threads and
glibc's malloc thresholds. Part of the device layer (``engine.device`` re-exports every name
here); nothing in this module names an accelerator.
"""

from __future__ import annotations

import os

import torch


def cpu_native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX512-BF16 or AMX tiles), as torch's
    oneDNN build reports it; False where torch cannot tell."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and (torch.cpu._is_avx512_bf16_supported()
                         or torch.cpu._is_amx_tile_supported()))
    except (AttributeError, RuntimeError):
        return False


def cpu_packed_gemm(dtype: torch.dtype) -> bool:
    """Whether CPU linear layers of ``dtype`` run on oneDNN's prepacked weights
    (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the pair that
    torch inductor's CPU freezing uses): float32 wherever torch has oneDNN, bfloat16 where
    the CPU runs it natively (:func:`cpu_native_bf16`). ``FERRY_CPU_PACKED_GEMM=0`` turns
    it off (plain ``F.linear``), for comparisons."""
    if os.environ.get("FERRY_CPU_PACKED_GEMM", "1") == "0":
        return False
    try:
        if not (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            return False
    except (AttributeError, RuntimeError):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and cpu_native_bf16()



def cpu_thread_count(requested: int | None = None) -> int:
    """Intra-op threads for the engine: ``requested``, else ``$OMP_NUM_THREADS`` when set,
    else the cores this process may run on (``os.sched_getaffinity``: a container's or
    taskset's limit, not the host's core count)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if requested:
        return int(requested)
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)


def set_cpu_threads(n: int) -> None:
    """Set torch's intra-op thread count (inter-op stays torch's default)."""
    torch.set_num_threads(max(1, int(n)))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_TUNED: list[str] = []


def tune_cpu_malloc() -> str | None:
    """Keep the CPU's activation memory mapped between steps (glibc only; once per process).

    glibc serves a request above its mmap threshold (128 KiB at start, raised dynamically
    up to 32 MiB) with a fresh ``mmap`` and unmaps it on free, and trims the top of its heap
    back to the OS; every step's activations (a 2048-token chunk's MLP output is 12 MiB in
    bf16) are then page-faulted and zeroed again by the kernel: 23-76k minor faults per
    bs8 x 256 ``bench-latency`` run in steady state, 0-3k with this (docs/benchmarks.md,
    "An AMX machine"). This sets ``M_MMAP_THRESHOLD`` to its 32 MiB maximum and
    ``M_TRIM_THRESHOLD`` to 1 GiB, so freed blocks stay in the heap for the next step, as
    tcmalloc or jemalloc (what vLLM's CPU build preloads) would keep them. The price: the process keeps up to 1 GiB of freed heap
    memory mapped (a step's peak activations; blocks over 32 MiB are still unmapped on free).
    ``FERRY_CPU_MALLOC=default`` leaves glibc as it is.

    Returns:
        what was set, for the start-up log; None where nothing was (not glibc, turned off,
        or already done in this process).
    """
    if _MALLOC_TUNED or os.environ.get("FERRY_CPU_MALLOC", "") == "default":
        return None
    _MALLOC_TUNED.append("done")
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return None
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 \
            and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):
        return None
    return "glibc malloc keeps blocks under 32 MiB in its heap (mmap threshold 32 MiB, " \
           "trim threshold 1 GiB; FERRY_CPU_MALLOC=default turns it off)" if ok else None
