"""DeepSeek's grouped routing (kernels/moe/reference.py ``select_experts_grouped``) against
HF's V2 and V3 routers: the same experts with the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from kernels.moe.reference import select_experts_grouped


def _sorted(w, ids):
    order = ids.long().argsort(dim=-1)
    return w.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("norm", [True, False])
def test_v3_sigmoid_noaux_tc(norm):
    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
                           n_routed_experts=16, num_experts_per_tok=3,
                           n_group=4, topk_group=2, norm_topk_prob=norm,
                           routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    router.weight.data.normal_()
    router.e_score_correction_bias.data.normal_(0, 0.5)
    x = torch.randn(32, 16)
    _, w_ref, ids_ref = router(x)
    w, ids = select_experts_grouped(x @ router.weight.T, 3, scoring="sigmoid", n_group=4,
                                    topk_group=2, group_score="top2",
                                    correction_bias=router.e_score_correction_bias,
                                    renormalize=norm, routed_scaling_factor=2.5)
    for a, b in zip(_sorted(w, ids), _sorted(w_ref, ids_ref)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("method,groups", [("greedy", 1), ("group_limited_greedy", 4)])
def test_v2_softmax(method, groups):
    torch.manual_seed(1)
    cfg = DeepseekV2Config(hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
                           n_routed_experts=16, num_experts_per_tok=3,
                           n_group=groups, topk_group=min(2, groups), topk_method=method,
                           routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(cfg)
    router.weight.data.normal_()
    x = torch.randn(32, 16)
    _, w_ref, ids_ref = router(x)
    w, ids = select_experts_grouped(x @ router.weight.T, 3, scoring="softmax",
                                    n_group=groups, topk_group=min(2, groups),
                                    routed_scaling_factor=1.5)
    for a, b in zip(_sorted(w, ids), _sorted(w_ref, ids_ref)):
        torch.testing.assert_close(a, b)


def test_refuses_inconsistent_groups():
    with pytest.raises(ValueError, match="inconsistent"):
        select_experts_grouped(torch.randn(2, 10), 2, scoring="softmax", n_group=4)
    with pytest.raises(ValueError, match="sigmoid"):
        select_experts_grouped(torch.randn(2, 8), 2, scoring="relu")
