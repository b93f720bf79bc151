"""The device layer: the only module in ferry that names a backend (cuda, xpu).

Everything else asks this module for synchronisation, memory figures, graphs, streams and
the distributed backend, so the XPU path is the same code as the CUDA path. A unit test
greps the tree to keep it that way.

XPU facts respected here: ``torch.xpu.mem_get_info`` fails on some older integrated Intel
GPUs, so free memory falls back to total minus reserved; ``torch.xpu.XPUGraph`` exists from
torch 2.11 on; the distributed backend is ``xccl``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cuda", "xpu", "cpu")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def resolve_device(name: str = "auto") -> str:
    """Resolve ``auto|cuda|xpu|cpu`` to a concrete device type.

    ``auto`` picks cuda if available, then xpu, then cpu.

    Raises:
        ValueError: an unknown name, or a device that is not available here.
    """
    name = (name or "auto").lower()
    if name not in DEVICE_CHOICES:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if _xpu_available():
            return "xpu"
        return "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    if name == "xpu" and not _xpu_available():
        raise ValueError("--device xpu was asked for, but torch sees no XPU device")
    return name


_BF16_HINT_LOGGED = False


def resolve_dtype(name: str, device_type: str) -> torch.dtype:
    """Resolve ``auto|bfloat16|float16|float32``; auto is bf16 on GPUs and fp32 on the CPU."""
    name = (name or "auto").lower()
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
             "fp32": torch.float32, "float": torch.float32}
    if name == "auto":
        if device_type != "cpu":
            return torch.bfloat16
        global _BF16_HINT_LOGGED
        if cpu_native_bf16() and not _BF16_HINT_LOGGED:
            _BF16_HINT_LOGGED = True
            logger.info("dtype float32 (the CPU default, for parity with HF fp32); this CPU "
                        "has native bf16 matmuls: --dtype bfloat16 decodes ~2x faster "
                        "(docs/benchmarks.md, CPU)")
        return torch.float32
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if device_type == "cpu" and table[name] == torch.bfloat16 and not cpu_native_bf16():
        logger.warning("--dtype bfloat16 on a CPU without AVX512-BF16 or AMX: torch emulates "
                       "bf16 matmuls there, usually slower than float32")
    return table[name]


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


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """KV cache dtype: ``auto`` is the model dtype; ``fp8_e4m3`` (or ``fp8``, vLLM's short
    form) / ``fp8_e5m2`` are torch's ``float8_e4m3fn`` / ``float8_e5m2``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return model_dtype
    table = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}
    if name not in table:
        raise ValueError(f"unknown kv cache dtype {name!r}; use auto, fp8_e4m3 or fp8_e5m2")
    return table[name]


def is_accelerator(device_type: str) -> bool:
    return device_type in ("cuda", "xpu")


def use_triton(device_type: str) -> bool:
    """Triton kernels run on cuda and xpu; the CPU uses the torch reference kernels."""
    return is_accelerator(device_type)


def default_attention_backend(device_type: str) -> str:
    """The attention backend without ``--attention-backend``: ``triton`` on cuda and xpu,
    ``torch_native`` (the torch reference kernels) on the CPU."""
    return "triton" if use_triton(device_type) else "torch_native"


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


def _mod(device_type: str):
    if device_type == "cuda":
        return torch.cuda
    if device_type == "xpu":
        return torch.xpu
    return None


def synchronize(device_type: str) -> None:
    mod = _mod(device_type)
    if mod is not None:
        mod.synchronize()


def empty_cache(device_type: str) -> None:
    mod = _mod(device_type)
    if mod is not None:
        mod.empty_cache()


def set_device(device_type: str, index: int = 0) -> None:
    mod = _mod(device_type)
    if mod is not None:
        mod.set_device(index)


def manual_seed_all(device_type: str, seed: int) -> None:
    mod = _mod(device_type)
    if mod is not None:
        mod.manual_seed_all(seed)


@dataclass
class MemoryInfo:
    """Device memory figures in bytes."""

    free: int
    total: int
    allocated: int


def memory_info(device_type: str) -> MemoryInfo:
    """Free, total and torch-allocated memory of the current device, in bytes.

    On the CPU, free and total come from the OS (available and total RAM).
    """
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info()
        return MemoryInfo(free, total, torch.cuda.memory_allocated())
    if device_type == "xpu":
        props = torch.xpu.get_device_properties()
        total = props.total_memory
        try:
            free, total = torch.xpu.mem_get_info()
        except Exception:  # older integrated GPUs: no mem_get_info
            free = total - torch.xpu.memory_reserved()
        return MemoryInfo(free, total, torch.xpu.memory_allocated())
    import os

    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return MemoryInfo(avail * size, pages * size, 0)
    except (ValueError, OSError):
        return MemoryInfo(8 << 30, 16 << 30, 0)


def device_name(device_type: str) -> str:
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    if device_type == "xpu":
        return torch.xpu.get_device_name()
    import platform

    return platform.processor() or "cpu"


def multiprocessor_count(device_type: str) -> int:
    """Streaming multiprocessors (CUDA) or Xe cores (XPU); CPU cores on the CPU."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties().multi_processor_count
    if device_type == "xpu":
        props = torch.xpu.get_device_properties()
        return int(getattr(props, "gpu_subslice_count", 0) or getattr(props, "max_compute_units", 64))
    import os

    return os.cpu_count() or 1


def graph_class(device_type: str):
    """The graph-capture class for the device, or None where graphs are unavailable.

    CUDA: ``torch.cuda.CUDAGraph``. XPU: ``torch.xpu.XPUGraph`` (torch >= 2.11).
    """
    if device_type == "cuda":
        return torch.cuda.CUDAGraph
    if device_type == "xpu":
        return getattr(torch.xpu, "XPUGraph", None)
    return None


def graph_context(device_type: str, graph, pool=None, stream=None):
    """Context manager that captures into ``graph`` (``torch.cuda.graph`` or ``torch.xpu.graph``)."""
    if device_type == "cuda":
        return torch.cuda.graph(graph, pool=pool, stream=stream)
    if device_type == "xpu":
        return torch.xpu.graph(graph, pool=pool, stream=stream)
    raise RuntimeError(f"no graphs on {device_type}")


def graph_pool_handle(device_type: str):
    if device_type == "cuda":
        return torch.cuda.graph_pool_handle()
    if device_type == "xpu" and hasattr(torch.xpu, "graph_pool_handle"):
        return torch.xpu.graph_pool_handle()
    return None


def set_blas_library(device_type: str, library: str) -> bool:
    """Prefer ``library`` ("default", "cublas" or "cublaslt") for matmuls on CUDA; returns
    False (and does nothing) on other devices."""
    if device_type != "cuda":
        return False
    torch.backends.cuda.preferred_blas_library(library)
    return True


def stream_class(device_type: str):
    mod = _mod(device_type)
    return None if mod is None else mod.Stream


def event_class(device_type: str):
    mod = _mod(device_type)
    return None if mod is None else mod.Event


def current_stream(device_type: str):
    mod = _mod(device_type)
    return None if mod is None else mod.current_stream()


def stream_context(device_type: str, stream):
    """``torch.cuda.stream(s)`` / ``torch.xpu.stream(s)``; a no-op context on the CPU."""
    import contextlib

    mod = _mod(device_type)
    if mod is None or stream is None:
        return contextlib.nullcontext()
    return mod.stream(stream)


def dist_backend(device_type: str) -> str:
    """The torch.distributed backend: nccl (cuda), xccl (xpu) or gloo (cpu)."""
    return {"cuda": "nccl", "xpu": "xccl"}.get(device_type, "gloo")


def graphs_capture_collectives(device_type: str) -> bool:
    """Whether a device graph may hold the tensor-parallel collectives: NCCL collectives are
    capturable in CUDA graphs (NCCL >= 2.9.6, torch >= 2.1); XCCL inside an XPUGraph is not
    documented by torch, so tensor-parallel XPU steps run eagerly."""
    return device_type == "cuda"


def visible_device_count(device_type: str) -> int:
    mod = _mod(device_type)
    return 1 if mod is None else mod.device_count()


_FP8_BACKENDS: dict[str, str] = {}


def fp8_linear_backend(device_type: str) -> str:
    """How FP8 (e4m3) linear layers multiply on ``device_type``: ``"scaled_mm"`` or
    ``"dequant"``. Decided once per device type and logged.

    ``scaled_mm``: ``torch._scaled_mm`` with row-wise fp32 scales (per token x per output
    channel). CUDA needs compute capability >= 8.9 (Ada, Hopper, Blackwell; CUTLASS or
    cuBLASLt kernels); XPU needs a torch whose oneDNN backs ``_scaled_mm`` (torch >= 2.10).
    Either way a 32x16 probe multiplication must run and give the right answer, so a
    build without the row-wise kernels falls back instead of failing mid-step.
    ``dequant``: the weights are upcast and multiplied in a float dtype (the CPU reference,
    and older GPUs).
    """
    if device_type not in _FP8_BACKENDS:
        backend, why = _choose_fp8_backend(device_type)
        _FP8_BACKENDS[device_type] = backend
        logger.info("FP8 linear layers on %s: %s (%s)", device_type, backend, why)
    return _FP8_BACKENDS[device_type]


def triton_fp8_mma(device_type: str) -> bool:
    """Whether Triton's ``tl.dot`` of two e4m3 operands runs on FP8 tensor cores here: CUDA
    with compute capability >= 8.9. (XPU: not claimed; triton-xpu's FP8 dot is untested.)"""
    return device_type == "cuda" and torch.cuda.is_available() \
        and torch.cuda.get_device_capability() >= (8, 9)


def _choose_fp8_backend(device_type: str) -> tuple[str, str]:
    if device_type == "cuda":
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9):
            return "dequant", f"compute capability {cap[0]}.{cap[1]} < 8.9: no FP8 tensor cores"
    elif device_type != "xpu":
        return "dequant", "reference: fp32 matmul of the dequantized operands"
    if not hasattr(torch, "_scaled_mm"):
        return "dequant", "this torch has no _scaled_mm"
    try:
        fp8 = torch.float8_e4m3fn
        a = torch.full((32, 16), 2.0, device=device_type).to(fp8)
        b = torch.full((16, 16), 0.5, device=device_type).to(fp8)
        sa = torch.full((32, 1), 0.5, device=device_type)
        sb = torch.full((1, 16), 4.0, device=device_type)
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        if not bool((out.float() == 32.0).all()):  # 16 x (2 x 0.5) x 0.5 x 4
            return "dequant", "torch._scaled_mm probe gave a wrong result"
    except Exception as e:  # noqa: BLE001 - any failure of the probe means: do not use it
        return "dequant", f"torch._scaled_mm with row-wise scales failed here: {e}"
    return "scaled_mm", "torch._scaled_mm, row-wise scales, bf16 output"
