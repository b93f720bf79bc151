"""DeepSeek's MoE MLP, shared by the families that route like DeepSeek (DeepSeek-V2/V3 in
:mod:`engine.models.deepseek`, GLM-4.5/4.6 in :mod:`engine.models.glm4_moe`).

A layer below ``first_k_dense_replace`` (``ModelConfig.mlp_only_layers``) has the dense
:class:`engine.models.blocks.GatedMLP`; every other layer
:class:`engine.layers.moe_grouped.GroupedMoeBlock`: the grouped router
(:class:`engine.layers.moe_grouped.GroupedRouting`), the routed experts and
``n_shared_experts`` shared experts as one MLP of width ``n_shared_experts x
moe_intermediate_size`` (``ModelConfig.shared_expert_intermediate_size``). Under tensor
parallelism the shared MLP's output is a per-rank partial sum, added to the routed experts'
before the block's one all-reduce.

Checkpoint names (HF's): ``mlp.gate.weight`` ``[E, H]`` and ``mlp.gate.e_score_correction_bias``
``[E]`` (the router, fp32, replicated), ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (stacked
by :class:`engine.models.moe.MoeForCausalLM`), ``mlp.shared_experts.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from torch import nn

from engine.layers.moe import ExpertOptions
from engine.layers.moe_grouped import GroupedMoeBlock, GroupedRouting
from engine.models.blocks import GatedMLP
from engine.models.config import ModelConfig


def sigmoid_routing(text) -> GroupedRouting:
    """DeepSeek-V3's router (also GLM-4.5's): sigmoid scores, ``e_score_correction_bias``
    for the choice, groups ranked by the sum of their two best experts, ``norm_topk_prob``
    and ``routed_scaling_factor`` from the HF config ``text``."""
    return GroupedRouting(scoring="sigmoid", n_group=int(getattr(text, "n_group", 1) or 1),
                          topk_group=int(getattr(text, "topk_group", 1) or 1),
                          group_score="top2", correction_bias=True,
                          renormalize=bool(getattr(text, "norm_topk_prob", False)),
                          routed_scaling_factor=float(
                              getattr(text, "routed_scaling_factor", 1.0) or 1.0))


def grouped_moe_mlp(config: ModelConfig, layer_id: int, dtype, routing: GroupedRouting,
                    options: ExpertOptions | None = None) -> nn.Module:
    """Layer ``layer_id``'s MLP: :class:`GatedMLP` for a dense layer, else the
    :class:`GroupedMoeBlock` with ``routing`` and the shared experts (none when
    ``n_shared_experts`` is 0); ``options``: the experts' (block-FP8)."""
    if not config.is_moe_layer(layer_id):
        return GatedMLP(config, dtype)
    shared = (GatedMLP(config, dtype, config.shared_expert_intermediate_size,
                       reduce_results=False)
              if config.shared_expert_intermediate_size else None)
    return GroupedMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                           config.moe_intermediate_size, dtype, routing, shared_experts=shared,
                           options=options)


def grouped_moe_weight_shape(config: ModelConfig, name: str, dense_shape
                             ) -> tuple[int, ...] | None:
    """The full shape of the router's and the shared experts' checkpoint tensors (``name``),
    None for any other; ``dense_shape(name, inter)`` gives a dense MLP tensor's shape at
    width ``inter``."""
    if name.endswith(".mlp.gate.weight"):
        return (config.num_experts, config.hidden_size)
    if name.endswith(".mlp.gate.e_score_correction_bias"):
        return (config.num_experts,)
    if ".mlp.shared_experts." in name:
        return dense_shape(name, config.shared_expert_intermediate_size)
    return None


__all__ = ["grouped_moe_mlp", "grouped_moe_weight_shape", "sigmoid_routing"]
