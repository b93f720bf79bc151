"""The device layer: the only package in ferry that names a backend (cuda, xpu).

Everything else asks this package for synchronisation, memory figures, graphs, streams and
the distributed backend, so the XPU path is the same code as the CUDA path. A unit test
greps the tree to keep it that way. ``engine/device/graphs.py`` (graph classes, when to
capture, the capture fallback and the replay check) and ``engine/device/cpu.py`` (the CPU's
knobs) are re-exported here, so callers write ``dev.graph_class`` as before.

XPU facts respected here (sources in docs/deployment.md, "Intel GPUs"):
``torch.xpu.mem_get_info`` fails on some older integrated Intel GPUs and does not drop after
torch allocates on others (Arc B-series, Data Center GPU Max), so free memory is then
total minus what torch reserved minus ``XPU_UNTRACKED_RESERVE`` for what it holds outside
torch; ``torch.xpu.XPUGraph`` exists from torch 2.11 on and is
opt-in on every torch until a run on Intel hardware (``graphs.py``); the distributed backend is ``xccl``, torn down before a
worker exits; bf16 is not the default on an Arc A770.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from engine.device.accel import _mod as _mod
from engine.device.accel import empty_cache as empty_cache
from engine.device.accel import synchronize as synchronize
from engine.device.cpu import cpu_native_bf16
from engine.device.cpu import cpu_packed_gemm as cpu_packed_gemm
from engine.device.cpu import cpu_thread_count as cpu_thread_count
from engine.device.cpu import set_cpu_threads as set_cpu_threads
from engine.device.cpu import tune_cpu_malloc as tune_cpu_malloc
from engine.device.graphs import capture_or_eager as capture_or_eager
from engine.device.graphs import coarse_graph_buckets as coarse_graph_buckets
from engine.device.graphs import graph_check_skipped as graph_check_skipped
from engine.device.graphs import graph_class as graph_class
from engine.device.graphs import graph_context as graph_context
from engine.device.graphs import graph_pool_handle as graph_pool_handle
from engine.device.graphs import graphs_capture_collectives as graphs_capture_collectives
from engine.device.graphs import graphs_enabled as graphs_enabled
from engine.device.graphs import replay_matches_eager as replay_matches_eager
from engine.device.graphs import replay_or_none as replay_or_none

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
        if device_type == "xpu" and not xpu_bf16_default():
            logger.warning("dtype float16 on %s: vLLM falls back from bfloat16 on the Arc "
                           "A770 for a known bf16 accuracy issue; --dtype bfloat16 "
                           "overrides", device_name("xpu"))
            return torch.float16
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


def xpu_bf16_default() -> bool:
    """Whether ``--dtype auto`` may pick bf16 on this XPU: not on an Arc A770, where vLLM's
    XPU platform falls back to float16 ("bfloat16 accuracy known issue",
    ``XPUPlatform.device_support_bf16``)."""
    return "a770" not in device_name("xpu").lower()


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


def set_device(device_type: str, index: int = 0) -> None:
    mod = _mod(device_type)
    if mod is not None:
        mod.set_device(index)


def manual_seed_all(device_type: str, seed: int) -> None:
    mod = _mod(device_type)
    if mod is not None:
        mod.manual_seed_all(seed)


#: XPU bytes held outside torch's caching allocator that no free-memory figure reports when
#: the driver's is stuck (the Level Zero context and command lists, kernels compiled by IGC,
#: oneCCL's buffers under tensor parallelism): left out of the free memory the KV pool is
#: sized from (memory_info). An estimate, not a measurement; --max-total-tokens overrides
#: the sizing (docs/deployment.md, "Memory sizing")
XPU_UNTRACKED_RESERVE = 1 << 30


@dataclass
class MemoryInfo:
    """Device memory figures in bytes."""

    free: int
    total: int
    allocated: int


def memory_info(device_type: str) -> MemoryInfo:
    """Free, total and torch-allocated memory of the current device, in bytes.

    XPU: the driver's figure (``mem_get_info``, the SYCL free-memory query) where it is
    below ``total - torch.xpu.memory_reserved()``: there it counts torch's memory, and also
    other processes' and what this one holds outside torch. It does not drop after torch
    allocates on Arc B-series cards and 64 GiB Data Center GPU Max stacks (pytorch#161381,
    intel/torch-xpu-ops#4966), and older integrated GPUs have no such query at all; then
    ``free = total - reserved - XPU_UNTRACKED_RESERVE``: the weights are out of the budget,
    and so is an allowance for the device memory outside torch's allocator that nothing
    reports (the Level Zero context, the compiled kernels, oneCCL's buffers).
    On the CPU, free and total come from the OS (available and total RAM).
    """
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info()
        return MemoryInfo(free, total, torch.cuda.memory_allocated())
    if device_type == "xpu":
        total = torch.xpu.get_device_properties().total_memory
        driver_free = None
        try:
            driver_free, total = torch.xpu.mem_get_info()
        except Exception:  # noqa: BLE001 - older integrated GPUs: no free-memory query
            pass
        tracked = total - torch.xpu.memory_reserved()
        if driver_free is not None and driver_free < tracked:
            free = driver_free  # the driver sees torch's memory, so it sees the rest too
        else:  # stuck or absent: what torch holds, and an allowance for what it does not
            free = tracked - XPU_UNTRACKED_RESERVE
        return MemoryInfo(max(free, 0), total, torch.xpu.memory_allocated())
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
    return os.cpu_count() or 1


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


@contextlib.contextmanager
def stream_context(device_type: str, stream):
    """Run the block on the side ``stream`` (``torch.cuda.stream(s)`` / ``torch.xpu.stream(s)``)
    ordered with the current stream both ways: the side stream first waits for the work
    queued so far (a graph's warm-up must see its static buffers' zero fill: without the
    wait it read them before the fill and, in memory a freed engine left, took its garbage
    for indices: a device-side assert on the H200), and the current stream waits for the
    block's work on exit. A no-op context on the CPU."""
    mod = _mod(device_type)
    if mod is None or stream is None:
        yield
        return
    current = mod.current_stream()
    stream.wait_stream(current)
    try:
        with mod.stream(stream):
            yield
    finally:  # also when the block raised: its queued work is ordered before what follows
        current.wait_stream(stream)


def dist_backend(device_type: str) -> str:
    """The torch.distributed backend: nccl (cuda), xccl (xpu) or gloo (cpu)."""
    return {"cuda": "nccl", "xpu": "xccl"}.get(device_type, "gloo")


def visible_device_count(device_type: str) -> int:
    mod = _mod(device_type)
    return 1 if mod is None else mod.device_count()


def teardown_group_at_exit(backend: str) -> bool:
    """Whether a rank destroys its process group of ``backend`` when it leaves: gloo (so a
    process can build another group) and xccl, whose leftover oneCCL/Level Zero state can
    hang the next start on the same cards (vllm#46433 tears it down before a worker exits;
    ProcessGroupXCCL's shutdown is a no-op, intel/torch-xpu-ops#5071, so the destroy does
    not wait for the other ranks). Not nccl: its teardown waited for the exited ranks on
    the H200s (engine/distributed.py)."""
    return backend in ("gloo", "xccl")


def worker_teardown_at_exit(device_type: str) -> bool:
    """Whether a tensor-parallel worker destroys its group and releases device memory
    (:func:`release_memory`) before its process exits: on XPU, as vLLM's XPU worker
    shutdown does (vllm#46433: without it a restart on the same cards hung in oneCCL's first
    all-reduce). CUDA and CPU workers exit without (unchanged)."""
    return device_type == "xpu"


def release_memory(device_type: str) -> None:
    """Finish the queued device work, collect garbage and return torch's cached device memory
    (a worker's last step, :func:`worker_teardown_at_exit`, and ``LLM.shutdown``); failures
    are logged, not raised."""
    import gc

    try:
        synchronize(device_type)
        gc.collect()
        empty_cache(device_type)
    except Exception as e:  # noqa: BLE001 - best effort: nothing to undo
        logger.warning("releasing %s memory: %s", device_type, e)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without blocking the host: staged through pinned memory
    and copied ``non_blocking`` on an accelerator; the tensor itself on the CPU.

    A blocking ``.to(device)`` waits for the stream to drain (on XPU an in-order queue's
    ``memcpy().wait()``), so one such copy in the step path stalls the host until the
    in-flight step ends and the overlap is lost. The pinned block stays reserved by torch's
    caching host allocator until the copy has run.
    """
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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


def triton_fp8_e4m3(device_type: str) -> bool:
    """Whether Triton kernels here may load e4m3 (``tl.float8e4nv``) and upcast it, which the
    FP8 weight-only small-M kernel needs (no ``_scaled_mm``, no FP8 dot): CUDA with compute
    capability >= 8.9 (Triton's CUDA backend rejects the type below), and XPU
    (triton-xpu's backend sets ``allow_fp8e4nv``)."""
    if device_type == "xpu":
        return True
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
