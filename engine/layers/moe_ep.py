"""Expert parallelism (``--ep-size``, SGLang's meaning): the MoE layers' experts partitioned
over the tensor-parallel ranks, attention and dense layers still tensor-parallel.

With ``ep_size == tp_size = N`` rank ``r`` holds experts ``[r * E / N, (r + 1) * E / N)``
whole (their intermediate dimension is not split) and no part of the others. Routing is
unchanged and replicated: every rank runs the router over all E experts and gets the same
``topk_ids``. :func:`localize_topk` then maps the ids to this rank's local numbering and
every pair routed to another rank's expert to the sentinel ``-1`` with weight 0, which
the fused-MoE kernels (:func:`kernels.moe.reference.fused_moe_torch` and the Triton
:func:`kernels.moe.fused_moe.fused_moe`: alignment, GEMMs and top-k sum) skip without
computing it. Each rank's output is the sum over its own experts' pairs; the MoE block's
existing single all-reduce adds the ranks' partial outputs (and the TP-split shared
expert's), so an MoE layer still costs one all-reduce.

The size is set around model construction by the runner (:func:`expert_parallel`) and read
by :class:`engine.layers.moe.FusedMoE` (:func:`current_ep_size`); it is 1 outside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_EP_SIZE = 1


@contextlib.contextmanager
def expert_parallel(ep_size: int) -> Iterator[None]:
    """MoE layers built inside the ``with`` partition their experts over ``ep_size`` ranks
    (1: tensor parallelism splits every expert instead).

    Raises:
        ValueError: ``ep_size < 1``.
    """
    global _EP_SIZE
    if ep_size < 1:
        raise ValueError(f"--ep-size must be >= 1, got {ep_size}")
    prev, _EP_SIZE = _EP_SIZE, int(ep_size)
    try:
        yield
    finally:
        _EP_SIZE = prev


def current_ep_size() -> int:
    """The expert-parallel size for MoE layers being built now (1 outside
    :func:`expert_parallel`)."""
    return _EP_SIZE


def check_ep(num_experts: int, ep_size: int, tp_size: int) -> None:
    """Refuse an expert-parallel size that does not fit.

    Raises:
        ValueError: ``ep_size`` neither 1 nor ``tp_size``, or ``num_experts`` not divisible
            by it (naming the flags and the numbers).
    """
    if ep_size == 1:
        return
    if ep_size != tp_size:
        raise ValueError(f"--ep-size {ep_size} must be 1 or equal to --tp-size {tp_size} "
                         "(the experts are partitioned over the tensor-parallel ranks)")
    if num_experts % ep_size:
        raise ValueError(f"--ep-size {ep_size} does not divide the model's {num_experts} "
                         "experts (num_experts)")


def localize_topk(topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int,
                  num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global routing -> this rank's: ids in ``[first_expert, first_expert + num_local)``
    become ``id - first_expert``; every other pair gets the sentinel id ``-1`` (skipped by
    the fused-MoE kernels) and weight 0. Element-wise torch ops, no host sync (graph
    capturable).

    Args:
        topk_weights: ``[M, top_k]`` float routing weights.
        topk_ids: ``[M, top_k]`` int32/int64 global expert ids in ``[0, E)``.
        first_expert: this rank's first expert (``rank * num_local``).
        num_local: experts per rank (``E / ep_size``).

    Returns:
        ``(weights [M, top_k], ids [M, top_k])`` new tensors, the inputs' dtypes.
    """
    local = topk_ids - first_expert
    mine = (local >= 0) & (local < num_local)
    return topk_weights.masked_fill(~mine, 0.0), local.masked_fill(~mine, -1)


__all__ = ["check_ep", "current_ep_size", "expert_parallel", "localize_topk"]
