"""The MoE layer and the MoE model classes without an engine: the stacked expert weights and
their tensor-parallel split, the weight names and shapes (dummy weights, missing experts),
the MoE fields of ``ModelConfig``, and what is refused (FP8, OLMoE's ``clip_qkv``, GGUF).

The HF-parity and tensor-parallel runs are in ``tests/engine/test_moe_models.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.layers.moe import FusedMoE
from engine.layers.moe_ep import current_ep_size, expert_parallel, localize_topk
from engine.loader.loader import config_dir, load_config, load_model
from engine.loader.weights import iter_dummy_weights
from engine.models.config import ModelConfig
from kernels.moe.reference import fused_moe_torch

BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
TINY = {
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, head_dim=32,
                      mlp_only_layers=[1]),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                      intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, shared_expert_intermediate_size=48,
                      decoder_sparse_step=2),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe",
                  intermediate_size=32, num_experts=8, num_experts_per_tok=2),
}


def _write(tmp_path, case: str, **extra) -> str:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **TINY[case], **extra}))
    return str(tmp_path)


# ---- the layer ------------------------------------------------------------------------------


def test_expert_weight_loader_places_gate_up_down_and_splits_over_ranks():
    e, h, inter = 4, 8, 6
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(s, generator=g) for s in ((inter, h), (inter, h), (h, inter)))
    full = FusedMoE(e, 2, h, inter, True, torch.float32, tp_size=1, tp_rank=0)
    ranks = [FusedMoE(e, 2, h, inter, True, torch.float32, tp_size=2, tp_rank=r)
             for r in range(2)]
    for layer in (full, *ranks):
        layer.w13_weight.data.zero_()
        layer.w2_weight.data.zero_()
        for shard, t in (("gate", gate), ("up", up), ("down", down)):
            p = layer.w2_weight if shard == "down" else layer.w13_weight
            p.weight_loader(p, t, 2, shard)
    assert torch.equal(full.w13_weight[2], torch.cat([gate, up]))
    assert torch.equal(full.w2_weight[2], down)
    assert full.w13_weight[[0, 1, 3]].abs().sum() == 0          # other experts untouched
    for r, layer in enumerate(ranks):
        rows = slice(3 * r, 3 * r + 3)
        assert layer.w13_weight.shape == (e, 6, h) and layer.w2_weight.shape == (e, h, 3)
        assert torch.equal(layer.w13_weight[2], torch.cat([gate[rows], up[rows]]))
        assert torch.equal(layer.w2_weight[2], down[:, rows])

    # the ranks' partial outputs sum to the whole layer's output
    full.w13_weight.data.normal_(generator=g)
    full.w2_weight.data.normal_(generator=g)
    for layer in ranks:
        for ex in range(e):
            layer.weight_loader(layer.w13_weight, full.w13_weight[ex, :inter], ex, "gate")
            layer.weight_loader(layer.w13_weight, full.w13_weight[ex, inter:], ex, "up")
            layer.weight_loader(layer.w2_weight, full.w2_weight[ex], ex, "down")
    x, logits = torch.randn(5, h, generator=g), torch.randn(5, e, generator=g)
    whole = full(x, logits)
    assert torch.allclose(ranks[0](x, logits) + ranks[1](x, logits), whole, atol=1e-5)


def test_expert_weight_loader_errors():
    layer = FusedMoE(4, 2, 8, 6, False, torch.float32, tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match=r"expert gate tensor has shape \(6, 7\), expected"):
        layer.weight_loader(layer.w13_weight, torch.zeros(6, 7), 0, "gate")
    with pytest.raises(ValueError, match="expert id 4 is outside"):
        layer.weight_loader(layer.w13_weight, torch.zeros(6, 8), 4, "gate")
    with pytest.raises(ValueError, match="shard id must be"):
        layer.weight_loader(layer.w13_weight, torch.zeros(6, 8), 0, 1)
    with pytest.raises(ValueError, match="does not load into this parameter"):
        layer.weight_loader(layer.w13_weight, torch.zeros(8, 6), 0, "down")
    with pytest.raises(ValueError, match="not divisible by --tp-size 4"):
        FusedMoE(4, 2, 8, 6, False, torch.float32, tp_size=4, tp_rank=0)


def test_select_ops_sets_the_experts_impl(tmp_path):
    from engine.layers import select_ops

    model, _ = load_model(_write(tmp_path, "mixtral"), "dummy", device="cpu", progress=False)
    select_ops(model, "reference")
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2 and all(m.impl is fused_moe_torch for m in moes)


# ---- configs, names, shapes -----------------------------------------------------------------


def test_model_config_moe_fields(tmp_path):
    q3 = ModelConfig.from_hf(load_config(_write(tmp_path, "qwen3_moe")))
    assert (q3.num_experts, q3.num_experts_per_tok, q3.moe_intermediate_size,
            q3.intermediate_size, q3.norm_topk_prob) == (8, 2, 32, 96, True)
    assert [q3.is_moe_layer(i) for i in range(2)] == [True, False]
    q2 = ModelConfig.from_hf(load_config(_write(tmp_path, "qwen2_moe")))
    assert q2.shared_expert_intermediate_size == 48 and not q2.norm_topk_prob
    assert [q2.is_moe_layer(i) for i in range(2)] == [False, True]
    mx = ModelConfig.from_hf(load_config(_write(tmp_path, "mixtral")))
    assert (mx.num_experts, mx.moe_intermediate_size, mx.shared_expert_intermediate_size) \
        == (8, 32, 0)
    dense = ModelConfig.from_hf(load_config(config_dir("llama-tiny")))
    assert dense.num_experts == 0 and not dense.is_moe_layer(0)


@pytest.mark.parametrize("name,arch,params,tensors", [
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30_532_122_624, 3 + 48 * (9 + 128 * 3)),
    ("mixtral-8x7b", "MixtralForCausalLM", 46_702_792_704, 3 + 32 * (7 + 8 * 3)),
])
def test_shipped_moe_configs_build_at_their_size(name, arch, params, tensors):
    model, _ = load_model(config_dir(name), "dummy", device="meta", progress=False)
    assert type(model).__name__ == arch
    assert sum(p.numel() for p in model.parameters()) == params
    shapes = model.hf_weight_shapes()
    assert len(shapes) == len(model.expected_weights()) == tensors
    if arch == "MixtralForCausalLM":
        assert shapes["model.layers.31.block_sparse_moe.experts.7.w1.weight"] == (14336, 4096)
        assert shapes["model.layers.0.block_sparse_moe.experts.0.w2.weight"] == (4096, 14336)
        assert shapes["model.layers.0.block_sparse_moe.gate.weight"] == (8, 4096)
    else:
        assert shapes["model.layers.47.mlp.experts.127.up_proj.weight"] == (768, 2048)
        assert shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == (2048, 768)
        assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)


@pytest.mark.parametrize("case", list(TINY))
def test_dummy_weights_fill_every_parameter(case, tmp_path):
    """``--load-format dummy``: every tensor of ``hf_weight_shapes`` loads (none is
    reported unknown) and fills the expected keys, experts included."""
    model, _ = load_model(_write(tmp_path, case), "dummy", device="cpu", progress=False)
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == (1 if case in ("qwen3_moe", "qwen2_moe") else 2)
    for m in moes:
        m.w13_weight.data.zero_()
        m.w2_weight.data.zero_()
    loaded = model.load_weights(iter_dummy_weights(model, 0, torch.device("cpu")))
    assert loaded == model.expected_weights()
    for m in moes:   # every expert got its gate, up and down rows
        assert m.w13_weight.view(8, 2, 32, 64).abs().sum(dim=(2, 3)).gt(0).all()
        assert m.w2_weight.abs().sum(dim=(1, 2)).gt(0).all()


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    path = _write(tmp_path, "qwen3_moe")
    model, _ = load_model(path, "dummy", device="cpu", progress=False)
    gone = "model.layers.0.mlp.experts.5.up_proj.weight"
    tensors = {n: t.contiguous() for n, t in iter_dummy_weights(model, 0, torch.device("cpu"))
               if n != gone}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 weights: .*experts\.5\.up_proj\.weight"):
        load_model(path, device="cpu", progress=False)
    save_file({**tensors, gone: torch.zeros(32, 63)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj\.weight: expert up tensor "
                                         r"has shape \(32, 63\)"):
        load_model(path, device="cpu", progress=False)


# ---- refusals -------------------------------------------------------------------------------


def test_quantization_is_refused_for_moe_models(tmp_path):
    with pytest.raises(ValueError, match=r"--quantization fp8 is not supported for "
                                         r"Qwen3MoeForCausalLM, a mixture-of-experts model"):
        load_model(_write(tmp_path, "qwen3_moe"), "dummy", device="meta", quantization="fp8")
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with pytest.raises(ValueError, match=r"an FP8 checkpoint \(quant_method 'fp8'\) is not "
                                         r"supported for MixtralForCausalLM"):
        load_model(_write(tmp_path, "mixtral", quantization_config=fp8), "dummy",
                   device="meta")
    with pytest.raises(ValueError, match=r"--quantization awq is not supported for "
                                         r"Qwen3MoeForCausalLM.*4-bit expert weights"):
        load_model(_write(tmp_path, "qwen3_moe"), "dummy", device="meta", quantization="awq")
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
    with pytest.raises(ValueError, match=r"quant_method gptq \(gptq\) is not supported for "
                                         r"MixtralForCausalLM"):
        load_model(_write(tmp_path, "mixtral", quantization_config=gptq), "dummy",
                   device="meta")


def test_olmoe_clip_qkv_is_refused(tmp_path):
    with pytest.raises(ValueError, match="clip_qkv=8.0 is not supported"):
        load_model(_write(tmp_path, "olmoe", clip_qkv=8.0), "dummy", device="meta")


@pytest.mark.parametrize("arch,hf", [("qwen3moe", "Qwen3MoeForCausalLM"),
                                     ("llama", "MixtralForCausalLM")])
def test_moe_gguf_is_refused(arch, hf, tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = str(tmp_path / "m.gguf")
    w = GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.expert_count", 8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=f"GGUF weights of mixture-of-experts models are not "
                                         f"supported .*'{arch}', 8 experts: {hf}"):
        load_model(path, device="meta")


# ---- expert parallelism (--ep-size) ---------------------------------------------------------


def test_fused_moe_torch_skips_sentinel_ids_hand_computed():
    """H 2, I 1, E 2: expert 0 is gate (1, 0), up (2, 0), down (1, 0.5); expert 1 would add
    1000s. Pairs with ids -1 or >= E (another rank's experts) contribute nothing."""
    w13 = torch.tensor([[[1.0, 0.0], [2.0, 0.0]], [[1000.0, 0.0], [1000.0, 0.0]]])
    w2 = torch.tensor([[[1.0], [0.5]], [[1000.0], [1000.0]]])
    x = torch.tensor([[1.0, 0.0], [3.0, 5.0], [1.0, 0.0]])
    ids = torch.tensor([[0, -1], [-1, -1], [2, 0]], dtype=torch.int32)
    w = torch.tensor([[0.5, 7.0], [1.0, 1.0], [9.0, 0.25]])
    out = fused_moe_torch(x, w13, w2, w, ids)
    act = 2.0 / (1.0 + math.exp(-1.0))               # silu(1) * 2 = 1.4621171...
    want = torch.tensor([[0.5 * act, 0.25 * act], [0.0, 0.0], [0.25 * act, 0.125 * act]])
    assert torch.allclose(out, want, rtol=1e-6, atol=0), out


def test_localize_topk_hand_case():
    w = torch.tensor([[0.6, 0.4], [0.9, 0.1]])
    ids = torch.tensor([[5, 2], [3, 4]], dtype=torch.int32)     # E 8, ep 2: rank 1 has 4..7
    lw, li = localize_topk(w, ids, 4, 4)
    assert li.tolist() == [[1, -1], [-1, 0]] and li.dtype == torch.int32
    assert lw.tolist() == [[pytest.approx(0.6), 0.0], [0.0, pytest.approx(0.1)]]


def test_expert_parallel_layer_holds_whole_local_experts():
    """ep 2: rank r holds experts [2r, 2r + 2) whole (I not split) and skips the others'
    tensors; the two ranks' outputs sum to the float64 definition over all 4 experts."""
    e, h, inter, top_k = 4, 8, 6, 2
    g = torch.Generator().manual_seed(1)
    parts = {(ex, s): torch.randn(shape, generator=g, dtype=torch.float64)
             for ex in range(e) for s, shape in (("gate", (inter, h)), ("up", (inter, h)),
                                                 ("down", (h, inter)))}
    ranks = [FusedMoE(e, top_k, h, inter, True, torch.float32, tp_size=2, tp_rank=r,
                      ep_size=2) for r in range(2)]
    for r, layer in enumerate(ranks):
        assert layer.w13_weight.shape == (2, 2 * inter, h) and layer.w2_weight.shape == (2, h, inter)
        layer.w13_weight.data.fill_(float("nan"))
        layer.w2_weight.data.fill_(float("nan"))
        for (ex, s), t in parts.items():
            p = layer.w2_weight if s == "down" else layer.w13_weight
            p.weight_loader(p, t.float(), ex, s)
        for j in range(2):
            ex = 2 * r + j
            assert torch.equal(layer.w13_weight[j], torch.cat([parts[ex, "gate"],
                                                               parts[ex, "up"]]).float())
            assert torch.equal(layer.w2_weight[j], parts[ex, "down"].float())
    x = torch.randn(7, h, generator=g)
    logits = torch.randn(7, e, generator=g)
    probs = torch.softmax(logits.double(), -1)
    tw, ti = probs.topk(top_k, -1)
    tw = tw / tw.sum(-1, keepdim=True)
    want = torch.zeros(7, h, dtype=torch.float64)
    for m in range(7):
        for k in range(top_k):
            ex, xm = int(ti[m, k]), x[m].double()
            act = torch.nn.functional.silu(parts[ex, "gate"] @ xm) * (parts[ex, "up"] @ xm)
            want[m] += tw[m, k] * (parts[ex, "down"] @ act)
    got = (ranks[0](x, logits) + ranks[1](x, logits)).double()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_expert_parallel_start_up_errors(tmp_path):
    from engine.args import ServerArgs
    from engine.executor.tp_worker import check_tensor_parallel

    with pytest.raises(ValueError, match="--ep-size 2 must be 1 or equal to --tp-size 1"):
        ServerArgs(ep_size=2)
    with pytest.raises(ValueError, match="--ep-size 2 must be 1 or equal to --tp-size 4"):
        ServerArgs(ep_size=2, tp_size=4)
    with pytest.raises(ValueError, match="--ep-size 2 does not divide the model's 5 experts"):
        FusedMoE(5, 2, 8, 6, False, torch.float32, tp_size=2, tp_rank=0, ep_size=2)
    with pytest.raises(ValueError, match="must be 1 or equal to --tp-size 2"):
        FusedMoE(8, 2, 8, 6, False, torch.float32, tp_size=2, tp_rank=0, ep_size=4)
    path = _write(tmp_path, "mixtral", num_local_experts=6)
    with pytest.raises(ValueError, match="--ep-size 4 does not divide the model's 6 experts"):
        check_tensor_parallel(ServerArgs(model_path=path, tp_size=4, ep_size=4, device="cpu"),
                              "cpu")
    check_tensor_parallel(ServerArgs(model_path=path, tp_size=2, ep_size=2, device="cpu"), "cpu")


def test_ep_size_is_set_around_model_construction(tmp_path):
    """expert_parallel() reaches every MoE layer built inside it (the runner wraps
    load_model); a dense layer of the same model is unaffected."""
    with expert_parallel(2):
        assert current_ep_size() == 2
        with pytest.raises(ValueError, match="--ep-size 2 must be 1 or equal to --tp-size 1"):
            load_model(_write(tmp_path, "qwen3_moe"), "dummy", device="meta", progress=False)
    assert current_ep_size() == 1


def test_ep_size_is_ignored_with_a_log_line_for_a_dense_model(caplog):
    from engine.args import ServerArgs
    from engine.executor.tp_worker import check_tensor_parallel

    dense = config_dir("llama-tiny")
    with caplog.at_level("INFO", logger="ferry.engine"):
        check_tensor_parallel(ServerArgs(model_path=dense, tp_size=2, ep_size=2, device="cpu"),
                              "cpu")
    assert "--ep-size 2 ignored: LlamaForCausalLM has no MoE layers" in caplog.text
