"""DeepSeek's MoE block (V2/V3): a grouped, optionally biased router, the routed experts of
:class:`engine.layers.moe.FusedMoE`, and always-on shared experts::

    weights, ids = select_experts_grouped(gate(x), ...)     # kernels/moe/reference.py
    out = experts.run_routed(x, weights, ids) + shared_experts(x)
    out = all_reduce(out)                                   # tensor parallelism

Parameter names follow transformers: ``gate.weight`` ``[E, H]`` (and, for V3's "noaux_tc"
routing, ``gate.e_score_correction_bias`` ``[E]`` fp32), ``experts.w13_weight`` /
``experts.w2_weight`` (stacked from the checkpoint's per-expert tensors), ``shared_experts.*``.
The router's matmul runs in fp32 like HF's ``DeepseekV3TopkRouter``; the routing is the
torch reference on every device (the fused experts take the chosen ids and weights).

Under tensor (or expert) parallelism the routed experts' output is this rank's partial sum
(:class:`engine.layers.moe.FusedMoE`), the shared experts' too (their ``down_proj`` built with
``reduce_results=False``), and the block all-reduces once, as
:class:`engine.layers.moe.SparseMoeBlock` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce
from engine.layers.moe import ExpertOptions, FusedMoE
from kernels.moe.reference import select_experts_grouped


@dataclass(frozen=True)
class GroupedRouting:
    """A DeepSeek router's switches (see :func:`select_experts_grouped`).

    Attributes:
        scoring: ``"softmax"`` (V2) or ``"sigmoid"`` (V3).
        n_group, topk_group: expert groups and the groups a token may choose from.
        group_score: ``"max"`` (V2) or ``"top2"`` (V3).
        correction_bias: the router keeps ``e_score_correction_bias`` (V3's noaux_tc).
        renormalize: ``norm_topk_prob``.
        routed_scaling_factor: the routed weights' factor.
    """

    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    correction_bias: bool = False
    renormalize: bool = False
    routed_scaling_factor: float = 1.0


class GroupedRouter(nn.Module):
    """``x [T, H] -> (weights [T, K] fp32, ids [T, K] int32)`` of DeepSeek's routing."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 routing: GroupedRouting):
        super().__init__()
        self.top_k, self.routing = top_k, routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        if routing.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        logits = F.linear(x.float(), self.weight.float())
        return select_experts_grouped(
            logits, self.top_k, scoring=r.scoring, n_group=r.n_group, topk_group=r.topk_group,
            group_score=r.group_score, correction_bias=self.e_score_correction_bias,
            renormalize=r.renormalize, routed_scaling_factor=r.routed_scaling_factor)


class GroupedMoeBlock(nn.Module):
    """Router + routed experts + shared experts, one all-reduce under tensor parallelism.

    The router is replicated (every rank routes every token the same); the routed experts
    are split as :class:`FusedMoE` splits them (each expert's width over the ranks, or whole
    experts per rank with ``--ep-size``), the shared experts as a TP-split MLP; both give
    this rank's partial sum, added and all-reduced once.

    Args:
        hidden_size, num_experts, top_k, intermediate_size, dtype: as :class:`FusedMoE`.
        routing: the router's switches.
        shared_experts: a module x [T, H] -> [T, H] (DeepSeek's ``n_shared_experts``
            experts as one MLP) whose output is this rank's partial sum (built with
            ``reduce_results=False``), or None.
        options: the experts' :class:`engine.layers.moe.ExpertOptions` (block-FP8 experts).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 dtype: torch.dtype, routing: GroupedRouting,
                 shared_experts: nn.Module | None = None, options: ExpertOptions | None = None):
        super().__init__()
        self.gate = GroupedRouter(hidden_size, num_experts, top_k, routing)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size,
                                routing.renormalize, dtype, options=options)
        self.shared_experts = shared_experts
        self.tp_size = self.experts.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] (summed over the ranks)."""
        weights, ids = self.gate(x)
        out = self.experts.run_routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out) if self.tp_size > 1 else out


__all__ = ["GroupedMoeBlock", "GroupedRouter", "GroupedRouting"]
