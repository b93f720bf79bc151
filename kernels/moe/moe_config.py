"""Launch configurations of the fused-MoE grouped GEMM: tuned tables per device, and a default.

A configuration is a dict with the keys of :data:`CONFIG_KEYS`::

    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
     "num_warps": 4, "num_stages": 4}

``BLOCK_SIZE_M`` is also the padding unit of the token-to-expert alignment, so both GEMMs of
one :func:`kernels.moe.fused_moe.fused_moe` call share one configuration (as in vLLM and SGLang).

Tables (one JSON file per device, beside this module in ``moe_configs/``, written by
``bench/kernels/tune_fused_moe.py``). The file name is the device's name as
:func:`engine.device.device_name` reports it, with every run of characters other than
letters and digits replaced by ``_`` (:func:`device_config_file`): ``NVIDIA H200`` ->
``NVIDIA_H200.json``. Nothing here asks for a CUDA compute capability; an XPU gets its own
file by its own name. Layout::

    {
      "_meta": {...},                                   # keys starting with "_" are ignored
      "E=128,N=768,H=2048,dtype=bf16": {                 # experts, N = I (intermediate size
        "1":    {"BLOCK_SIZE_M": 16, ...},               #   per tensor-parallel rank), hidden
        "64":   {...},                                   #   size, activation dtype
        "4096": {...}                                    # M bucket (tokens) -> configuration
      }
    }

Lookup (:func:`get_moe_config`, given the device name by its caller): the file of the name (``FERRY_MOE_CONFIG_DIR``, when
set, replaces the directory), the entry of ``(E, N, H, dtype)``, then the M bucket nearest to
the call's M in log2 distance (a tie goes to the larger bucket). No file, no entry: the
default heuristic :func:`default_moe_config`. The lookup runs on the host from shapes only,
so it is safe inside graph capture. The same idea as vLLM's / SGLang's
``E=..,N=..,device_name=...json`` files (written from scratch here).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from pathlib import Path

import torch

from kernels.launch import dot_kernel_options

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).with_name("moe_configs")
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
               "num_stages")
_LOGGED_DEFAULT: set = set()
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype) -> str:
    """``bf16`` / ``fp16`` / ``fp32``; raises ValueError for other dtypes."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"fused MoE supports bf16, fp16 and fp32 activations, got {dtype}")
    return _DTYPE_NAMES[dtype]


def device_config_file(device_name: str) -> str:
    """The table's file name for a device name: ``"NVIDIA H200"`` -> ``"NVIDIA_H200.json"``."""
    stem = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    if not stem:
        raise ValueError(f"device name {device_name!r} gives an empty file name")
    return stem + ".json"


def table_key(num_experts: int, inter_size: int, hidden_size: int, dtype: torch.dtype) -> str:
    """The entry key of a shape: ``"E=128,N=768,H=2048,dtype=bf16"`` (N = I per rank)."""
    return f"E={num_experts},N={inter_size},H={hidden_size},dtype={dtype_name(dtype)}"


def check_config(cfg: dict, where: str = "config") -> dict:
    """Validate one configuration; returns a plain ``{key: int}`` copy.

    Raises:
        ValueError: a missing key, a block size that is not a power of two >= 16 (``tl.dot``
            needs 16 in every dimension), ``GROUP_SIZE_M < 1``, ``num_warps`` not a power of
            two in [1, 64], or ``num_stages < 1``.
    """
    missing = [k for k in CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    out = {k: int(cfg[k]) for k in CONFIG_KEYS}
    for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
        v = out[k]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{where}: {k} must be a power of two >= 16, got {v}")
    w = out["num_warps"]
    if out["GROUP_SIZE_M"] < 1 or w < 1 or w > 64 or w & (w - 1) or out["num_stages"] < 1:
        raise ValueError(f"{where}: bad GROUP_SIZE_M/num_warps/num_stages in {out}")
    return out


def config_dir(override: str | os.PathLike | None = None) -> Path:
    """``override``, else ``$FERRY_MOE_CONFIG_DIR``, else ``kernels/moe/moe_configs``."""
    if override is not None:
        return Path(override)
    env = os.environ.get("FERRY_MOE_CONFIG_DIR")
    return Path(env) if env else CONFIG_DIR


@functools.lru_cache(maxsize=64)
def load_table(path: str) -> dict[str, dict[int, dict]]:
    """Read and validate one device table; ``{}`` if the file does not exist. Cached per
    path (:func:`clear_cache` forgets it).

    Raises:
        ValueError: malformed JSON or a malformed configuration (the message names the file).
    """
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON: {e}") from e
    table: dict[str, dict[int, dict]] = {}
    for key, buckets in raw.items():
        if key.startswith("_"):
            continue
        if not isinstance(buckets, dict):
            raise ValueError(f"{p}: entry {key!r} must map M buckets to configurations")
        table[key] = {int(m): check_config(c, f"{p} [{key}][{m}]") for m, c in buckets.items()}
    return table


def clear_cache() -> None:
    """Forget the tables read so far (after the tuner rewrote one)."""
    load_table.cache_clear()


def nearest_bucket(m: int, buckets) -> int:
    """The bucket nearest to ``m`` in log2 distance; a tie goes to the larger bucket."""
    lm = math.log2(max(m, 1))
    return min(buckets, key=lambda b: (abs(math.log2(max(b, 1)) - lm), -b))


def default_moe_config(m: int, num_experts: int, inter_size: int, hidden_size: int,
                       top_k: int, dtype: torch.dtype, device_type: str = "cuda") -> dict:
    """The configuration used when no table matches: keyed on the average number of routed
    rows per expert ``m * top_k / E`` (the rows one expert's weight tile is reused for).

    * <= 8 rows (decode): ``16 x 64`` output tiles, ``BLOCK_SIZE_K`` 128: the weights stream;
    * <= 16: ``32 x 128`` (with ~16 rows an expert often spills into a second 16-row block,
      which reads its weights again); <= 64: ``64 x 128``; more: ``128 x 128``, 8 warps;
    * fp32 halves ``BLOCK_SIZE_K`` (twice the bytes per element, same shared memory).

    These are the H200's tuned winners for Qwen3-30B-A3B and Mixtral-8x7B by rows per expert
    (``kernels/moe/moe_configs/NVIDIA_H200.json``: both models picked the same tile at 16 rows,
    within a few percent elsewhere), as a starting point for other shapes and devices.
    CUDA: 3-4 pipeline stages. XPU: triton-xpu lowers ``tl.dot`` to DPAS on 16-lane
    sub-groups (a "warp" there is a 16-wide sub-group; 32 lanes without DPAS), so the XPU
    default doubles ``num_warps`` to keep the threads per tile of the CUDA choice, and uses
    triton-xpu's default of 2 stages (``kernels.launch.dot_kernel_options``, the rule of
    every kernel's table; untested on an XPU). A device table written by
    ``bench/kernels/tune_fused_moe.py`` replaces all of this.
    """
    del inter_size, hidden_size  # room for shape-aware rules; the tables cover shapes today
    rows = m * top_k / max(num_experts, 1)
    if rows <= 8:
        cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1,
                   num_warps=4, num_stages=4)
    elif rows <= 16:
        cfg = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=1,
                   num_warps=4, num_stages=3)
    elif rows <= 64:
        cfg = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=1,
                   num_warps=4, num_stages=3)
    else:
        cfg = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=16,
                   num_warps=8, num_stages=3)
    if dtype == torch.float32:
        cfg["BLOCK_SIZE_K"] = max(32, cfg["BLOCK_SIZE_K"] // 2)
        cfg["num_stages"] = min(cfg["num_stages"], 3)
    cfg.update(dot_kernel_options(cfg["num_warps"], cfg["num_stages"], device_type))
    return cfg


def get_moe_config(m: int, num_experts: int, inter_size: int, hidden_size: int, top_k: int,
                   dtype: torch.dtype, device_type: str, device_name: str | None = None,
                   directory: str | os.PathLike | None = None) -> dict:
    """The launch configuration for one fused-MoE call (see the module docstring).

    Args:
        m: tokens in the call (rows of ``hidden_states``).
        num_experts: E.  inter_size: I, the intermediate size per rank (w2 is ``[E, H, I]``).
        hidden_size: H.  top_k: experts per token.  dtype: activation dtype.
        device_type: ``cuda``, ``xpu`` or ``cpu`` (the CPU/interpreter gets the CUDA default).
        device_name: the device's name, which picks the table file; the caller takes it
            from :func:`engine.device.device_name` (kernels/ does not import engine/).
            None or empty: no table, the default.
        directory: table directory (default: ``$FERRY_MOE_CONFIG_DIR`` or ``moe_configs/``).

    Returns:
        A new dict with the keys of :data:`CONFIG_KEYS`.

    Raises:
        ValueError: an unsupported dtype, or a malformed table file.
    """
    key = table_key(num_experts, inter_size, hidden_size, dtype)
    if device_name:
        entry = load_table(str(config_dir(directory) / device_config_file(device_name)))
        buckets = entry.get(key)
        if buckets:
            return dict(buckets[nearest_bucket(m, buckets)])
        if (device_name, key) not in _LOGGED_DEFAULT:
            _LOGGED_DEFAULT.add((device_name, key))
            logger.info("fused MoE: no tuned configuration for %s on %r (looked in %s); "
                        "using the default heuristic (bench/kernels/tune_fused_moe.py writes one)",
                        key, device_name, config_dir(directory))
    return default_moe_config(m, num_experts, inter_size, hidden_size, top_k, dtype,
                              device_type)


__all__ = ["CONFIG_DIR", "CONFIG_KEYS", "check_config", "clear_cache", "config_dir",
           "default_moe_config", "device_config_file", "dtype_name", "get_moe_config",
           "load_table", "nearest_bucket", "table_key"]
