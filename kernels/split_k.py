"""Split-K bookkeeping shared by the small-M GEMM kernels (FP8 in
``kernels.fp8.fp8_triton``, 4-bit/8-bit weight-only in
:mod:`kernels.quant.wq_triton`).

A split-K launch runs ``SPLIT_K`` programs per block of output columns, each over a part of
K; each writes its fp32 partial to a scratch buffer, and the last of them to arrive (an
``acq_rel`` atomic counter per block of columns) sums the partials in K order (deterministic)
and writes the output, then resets its counter to 0 for the next launch (so a graph replay
finds it at 0). The counters live in one buffer per device, shared by every such kernel:
launches on one device must not run concurrently on two streams.
"""

from __future__ import annotations

import torch

#: the most blocks of output columns one split-K launch may have (the counters per device)
MAX_N_BLOCKS = 1 << 16
_LOCKS: dict[torch.device, torch.Tensor] = {}


def split_k_locks(device: torch.device) -> torch.Tensor:
    """The per-device arrival counters of split-K launches ([65536] int32, zero between
    launches). Allocated on first use: call it once before graph capture (the layers do, at
    load time)."""
    device = torch.device(device)
    if device not in _LOCKS:
        _LOCKS[device] = torch.zeros(MAX_N_BLOCKS, dtype=torch.int32, device=device)
    return _LOCKS[device]


def split_k_trusted(device_type: str) -> bool:
    """Whether the default configs may split K (the last program of an N block sums the
    other programs' partials, read back with ``.cg`` loads after an ``acq_rel`` atomic).
    Not on XPU until ``tests/kernels/test_triton_fp8_small_m.py`` (which runs split-K
    configs explicitly) has passed there: an Xe core's L1 is not coherent with the others',
    triton-xpu treats a non-predicated ``.cg`` load as a cached one
    (intel/intel-xpu-backend-for-triton#7901), and Intel calls communication between
    work-groups "not widely tested" (#6723), so a partial could be read stale."""
    return device_type != "xpu"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_k_launch(y: torch.Tensor, k: int, split: int, block_n: int, block_k: int,
                   m_blocks: int = 1) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """What a split-K launch writing ``y [M, N]`` needs: ``(n_blocks, k_per_split, part,
    locks)``, with ``k_per_split`` a whole number of ``block_k`` tiles, ``part`` the fp32
    partials ``[split, M, N]`` and ``locks`` the device's counters (both ``y`` itself when
    ``split`` is 1: unused). A kernel with ``m_blocks`` blocks of rows takes one counter per
    (block of rows, block of columns): ``m_block * n_blocks + n_block``.

    Raises:
        ValueError: more than ``MAX_N_BLOCKS`` output blocks with ``split > 1``.
    """
    m, n = y.shape
    n_blocks = _cdiv(n, block_n)
    k_per_split = _cdiv(_cdiv(k, split), block_k) * block_k
    if split == 1:
        return n_blocks, k_per_split, y, y
    if m_blocks * n_blocks > MAX_N_BLOCKS:
        raise ValueError(f"{m_blocks} x {n_blocks} output blocks > {MAX_N_BLOCKS}")
    part = torch.empty(split, m, n, dtype=torch.float32, device=y.device)
    return n_blocks, k_per_split, part, split_k_locks(y.device)
