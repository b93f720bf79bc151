"""Device graphs: the graph class of each device, whether to capture at all, a capture that
falls back to eager steps, and the start-up comparison of a replay with an eager step.

Part of the device layer (``engine.device`` re-exports every name here). The policy, from
the sources (docs/deployment.md, "Intel GPUs", says what each means for a deployment):

- CUDA: graphs on unless ``--disable-cuda-graph`` (unchanged).
- XPU: ``torch.xpu.XPUGraph`` ships with torch 2.11, built on SYCL graphs until torch 2.14
  moves it to Level Zero graphs (vllm#51600, an open upstream change). vLLM turned XPU graphs
  off by default right after moving to torch 2.11 ("requires a specific driver version, not
  stable", vllm#38193, opt-in with ``VLLM_XPU_ENABLE_XPU_GRAPH=1``), piecewise capture has
  given corrupt output on a Data Center GPU Max (vllm#48946) and graphs with collectives
  garbage under tensor parallelism (intel/llm-scaler#698). So XPU graphs are opt-in
  (``--enable-xpu-graph``) on every torch, 2.14 included, until a run on Intel hardware
  shows them right (:data:`XPU_GRAPHS_BY_DEFAULT`). Tensor-parallel XPU steps run eagerly
  either way (:func:`graphs_capture_collectives`).
- Every device: a capture or a replay that raises is logged with its reason and those steps
  run eagerly (:func:`capture_or_eager`, :func:`replay_or_none`); after the capture one
  replay is compared with an eager step (:func:`replay_matches_eager`,
  ``engine/executor/graph_setup.py``), and a replay that disagrees turns that kind of graph
  off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch

from engine.device.accel import empty_cache, synchronize

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: whether XPU graphs are on without ``--enable-xpu-graph``: not on any torch until a run on
#: Intel hardware (the start-up check included) shows their replays right; torch 2.14's
#: Level Zero graphs rest on an open upstream change (vllm#51600), not on a run
XPU_GRAPHS_BY_DEFAULT = False
#: ``FERRY_SKIP_GRAPH_CHECK=1`` skips the start-up replay-vs-eager comparison
SKIP_CHECK_ENV = "FERRY_SKIP_GRAPH_CHECK"


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


def graphs_capture_collectives(device_type: str) -> bool:
    """Whether a device graph may hold the tensor-parallel collectives: NCCL collectives are
    capturable in CUDA graphs (NCCL >= 2.9.6, torch >= 2.1). XCCL is not yet: a SYCL graph
    does not take in oneCCL's own queue (pytorch#196490, open), so tensor-parallel XPU steps
    run eagerly."""
    return device_type == "cuda"


def graphs_enabled(device_type: str, *, disable: bool = False,
                   enable_xpu: bool = False) -> tuple[bool, str]:
    """Whether to capture decode and piecewise graphs on ``device_type``, and why not.

    Args:
        disable: ``--disable-cuda-graph`` (every device).
        enable_xpu: ``--enable-xpu-graph`` (XPU graphs are opt-in, ``XPU_GRAPHS_BY_DEFAULT``).
    Returns:
        ``(on, reason)``; ``reason`` is empty when on, else a sentence for the log.
    """
    if disable:
        return False, "--disable-cuda-graph"
    if graph_class(device_type) is None:
        return False, f"this torch has no graph class for {device_type}"
    if device_type == "xpu" and not enable_xpu and not XPU_GRAPHS_BY_DEFAULT:
        return False, ("XPU graphs are opt-in until they are shown right on Intel hardware "
                       "(SYCL graphs not stable: vllm#38193); --enable-xpu-graph turns them on")
    return True, ""


def coarse_graph_buckets(device_type: str) -> bool:
    """Whether piecewise graphs get fewer, coarser token buckets: on XPU, where each piece's
    capture also waits for IGC's compile (900 graphs for a 32-layer model with the CUDA
    buckets could outlast the image's health-check start period)."""
    return device_type == "xpu"


def _recover(device_type: str) -> None:
    """After a failed capture: wait for the device and release what the capture held."""
    try:
        synchronize(device_type)
        empty_cache(device_type)
    except Exception as e:  # noqa: BLE001 - a device in an error state: the eager step says so
        logger.warning("after the failed capture the device reports: %s", e)


def capture_or_eager(device_type: str, what: str, build: Callable[[], T]) -> T | None:
    """``build()`` (a runner whose constructor captures graphs), or None when it raises: the
    reason is logged and the steps it would have replayed run eagerly.

    Under tensor parallelism the ranks agree afterwards (``engine/executor/graph_setup.py``);
    a rank that fails in the middle of the capture of a collective-holding graph can leave
    the others waiting in that collective until the group's timeout.
    """
    try:
        return build()
    except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
        logger.warning("%s: graph capture failed on %s (%s: %s); these steps run eagerly",
                       what, device_type, type(e).__name__, str(e).splitlines()[0] if str(e)
                       else "no message")
        _recover(device_type)
        return None


def replay_or_none(device_type: str, what: str, replay: Callable[[], T]) -> T | None:
    """``replay()`` (a graph replay's output), or None when it raises: one warning with the
    reason, the device is synchronised and its cache emptied, and the caller runs the step
    eagerly (and drops the graphs, so that the warning is not repeated every step).

    Under tensor parallelism a rank must not drop its graphs alone (its peers would
    all-reduce padded batches against its eager ones): the caller re-raises there instead.
    """
    try:
        return replay()
    except Exception as e:  # noqa: BLE001 - any replay failure means: run eagerly
        logger.warning("%s: a replay raised on %s (%s: %s); these steps run eagerly from now "
                       "on", what, device_type, type(e).__name__,
                       str(e).splitlines()[0] if str(e) else "no message")
        _recover(device_type)
        return None


def graph_check_skipped() -> bool:
    """``FERRY_SKIP_GRAPH_CHECK=1``: keep the graphs without the start-up comparison."""
    return os.environ.get(SKIP_CHECK_ENV, "") == "1"


def check_tolerance(dtype: torch.dtype) -> float:
    """The largest ``max |replay - eager|`` accepted, relative to the eager step's largest
    logit. A replay pads the batch to its bucket, so its GEMMs and split-KV counts may differ
    from the eager step's: fp32 agrees to ~1e-5 there, 16-bit dtypes to a few 1e-2 over a
    deep model; a broken replay (stale buffers, a wrong kernel) is off by the logits' scale."""
    return 1e-3 if dtype == torch.float32 else 0.1


def replay_matches_eager(replayed: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype,
                         top_k: int = 5) -> tuple[bool, str]:
    """Whether a graph replay's logits agree with an eager step's on the same batch.

    Agree means: the same shape; finite exactly where the eager logits are; ``max |replay -
    eager|`` within :func:`check_tolerance` of the eager step's largest logit; and every
    row's eager argmax among the replay's ``top_k`` (robust to near ties, not to garbage).

    Returns:
        ``(agree, detail)``: ``detail`` says what was measured (for the log).
    """
    if replayed.shape != eager.shape:
        return False, f"shape {tuple(replayed.shape)} vs {tuple(eager.shape)}"
    r, e = replayed.detach().float().cpu(), eager.detach().float().cpu()
    fin = torch.isfinite(e)
    if not torch.equal(torch.isfinite(r), fin):
        return False, "non-finite logits where the eager step's are finite (or the reverse)"
    if not bool(fin.any()):
        return True, "no finite logits to compare"
    scale = max(float(e[fin].abs().max()), 1e-6)
    diff = float((r - e)[fin].abs().max())
    tol = check_tolerance(dtype) * scale
    detail = f"max |replay - eager| {diff:.3g}, tolerance {tol:.3g}"
    if diff > tol:
        return False, detail
    k = min(top_k, r.shape[-1])
    top = torch.where(torch.isfinite(r), r, torch.full_like(r, float("-inf"))).topk(k, -1).indices
    hit = (top == e.nan_to_num(float("-inf")).argmax(-1, keepdim=True)).any(-1)
    if not bool(hit.all()):
        return False, f"{detail}; {int((~hit).sum())} row(s) whose eager argmax is not " \
                      f"among the replay's top {k}"
    return True, detail
