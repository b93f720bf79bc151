"""GGUF Q4_0/Q4_1/Q8_0 weights kept in their blocks (engine/layers/quantization/gguf.py).

- the repack into ferry's q4/q8 layouts dequantizes, bit for bit, to what gguf-py's own
  ``gguf.quants.dequantize`` gives, on random blocks and on blocks gguf-py quantized;
- the layer plan (which fused layers keep blocks) and the flags;
- the embedded SmolLM2 (Q4_1 linears, Q8_0 embedding): every linear weight of the block
  model dequantizes to the dequantized model's weight exactly, and served end to end
  (continuous batching, the C++ kernels at decode, the dequantize + GEMM path at prefill)
  both give the same greedy tokens; their log-probs differ only by fp32 summation order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.layers.quantization.gguf import (
    BLOCK_TYPES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q8_0,
    GgufBlocks,
    GgufConfig,
    repack,
)
from engine.loader.loader import keeps_gguf_blocks
from kernels.quant.reference import dequant, wq_matmul_ref

gguf = pytest.importorskip("gguf")


def _random_blocks(ggml_type: int, n: int, k: int, seed: int) -> np.ndarray:
    """Random block rows: random nibbles / int8, random finite fp16 scales (and mins)."""
    rng = np.random.default_rng(seed)
    nbytes = BLOCK_TYPES[ggml_type][1]
    raw = rng.integers(0, 256, size=(n, k // 32, nbytes), dtype=np.uint8)
    halves = 2 if ggml_type == Q4_1 else 1
    scales = (rng.standard_normal((n, k // 32, halves)) * 0.02).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(n, k // 32, 2 * halves)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (33, 608)])
def test_repack_matches_gguf_dequantize_random_blocks(ggml_type, n, k):
    raw = _random_blocks(ggml_type, n, k, seed=n * k + ggml_type)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
    packed = repack(GgufBlocks(raw, ggml_type, (n, k)))
    fmt = BLOCK_TYPES[ggml_type][2]
    w = dequant(fmt, packed["weight"], packed["weight_scale"], packed.get("weight_min"))
    assert w.shape == (n, k)
    np.testing.assert_array_equal(w.numpy(), ref)
    assert torch.equal(GgufBlocks(raw, ggml_type, (n, k)).materialize(), torch.from_numpy(ref))


@pytest.mark.parametrize("ggml_type", [Q4_0, Q4_1, Q8_0])
def test_repack_matches_gguf_quantized_floats(ggml_type):
    """Blocks written by gguf-py's quantizer from float weights (its rounding, its scales)."""
    qtype = gguf.GGMLQuantizationType(ggml_type)
    w = np.random.default_rng(3).standard_normal((5, 160)).astype(np.float32) * 0.1
    raw = gguf.quants.quantize(w, qtype)
    packed = repack(GgufBlocks(raw, ggml_type, (5, 160)))
    got = dequant(BLOCK_TYPES[ggml_type][2], packed["weight"], packed["weight_scale"],
                  packed.get("weight_min"))
    np.testing.assert_array_equal(got.numpy(), gguf.quants.dequantize(raw, qtype))
    assert np.abs(got.numpy() - w).max() < 0.05     # and it is the weight, approximately


def _random_q4_k(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_K super-blocks: random scale bytes and nibbles, finite fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    halves = (rng.standard_normal((n, k // 256, 2)) * 0.01).astype(np.float16)
    raw[..., :4] = halves.view(np.uint8).reshape(n, k // 256, 4)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("n,k", [(1, 256), (5, 768)])
def test_q4_k_repack_matches_gguf_dequantize(n, k):
    """Q4_K (6-bit sub-block scales and mins, nibbles of two sub-blocks per 32 bytes) ->
    q4 with fp32 scales and mins: gguf-py's dequantization bit for bit, through the torch
    reference and, where it builds, ferry's C++ kernel."""
    raw = _random_q4_k(n, k, seed=n + k)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    packed = repack(GgufBlocks(raw, Q4_K, (n, k)))
    assert packed["weight_scale"].dtype == torch.float32
    assert packed["weight_scale"].shape == (n, k // 32)
    w = dequant("q4", packed["weight"], packed["weight_scale"], packed["weight_min"])
    np.testing.assert_array_equal(w.numpy(), ref)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    y = wq_matmul_ref(x, "q4", packed["weight"], packed["weight_scale"], packed["weight_min"])
    want = x.double() @ torch.from_numpy(ref).double().t()
    assert (y.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_repack_refuses_other_types():
    q6k = int(gguf.GGMLQuantizationType.Q6_K)
    with pytest.raises(ValueError, match="Q6_K"):
        repack(GgufBlocks(np.zeros((1, 210), np.uint8), q6k, (1, 256)))


def test_layout_plan():
    q4k = int(gguf.GGMLQuantizationType.Q4_K)
    cfg = GgufConfig(types={"a.q.weight": Q4_1, "a.k.weight": Q4_0, "b.x.weight": Q8_0,
                            "c.x.weight": Q4_1, "c.y.weight": Q8_0, "d.x.weight": q4k})
    assert cfg.layout_of(["a.q.weight", "a.k.weight"]) == ("q4", "Q4_0/Q4_1")
    assert cfg.layout_of(["b.x.weight"]) == ("q8", "Q8_0")
    assert cfg.layout_of(["c.x.weight", "c.y.weight"])[0] is None    # 4- and 8-bit parts
    assert cfg.layout_of(["d.x.weight"]) == ("q4", "Q4_K")
    cfg.types["e.x.weight"] = int(gguf.GGMLQuantizationType.Q6_K)
    assert cfg.layout_of(["e.x.weight"]) == (None, "Q6_K")
    assert cfg.layout_of(["missing.weight"])[0] is None


def test_plan_names_the_types_it_dequantizes(caplog):
    """Layers whose GGUF types cannot keep their blocks (Q6_K, F16, a mix with them...) are
    dequantized with a warning that names the types; the others keep q4/q8."""
    import logging

    from transformers import LlamaConfig

    from engine.layers.quantization import quantization_scope
    from engine.layers.quantization.gguf import plan_layers
    from engine.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    plan = GgufConfig()
    with torch.device("meta"), quantization_scope(plan):
        model = LlamaForCausalLM(cfg, torch.float32)
    q4k, q6k = int(gguf.GGMLQuantizationType.Q4_K), int(gguf.GGMLQuantizationType.Q6_K)
    p = "model.layers.0."
    plan.types = {p + "self_attn.q_proj.weight": q4k, p + "self_attn.k_proj.weight": q4k,
                  p + "self_attn.v_proj.weight": q6k, p + "self_attn.o_proj.weight": Q4_1,
                  p + "mlp.gate_proj.weight": Q4_1, p + "mlp.up_proj.weight": q4k,
                  p + "mlp.down_proj.weight": 1}  # F16
    with caplog.at_level(logging.WARNING, logger="engine.layers.quantization.gguf"):
        assert plan_layers(model, plan, torch.float32) == (2, 2)
    text = caplog.text
    assert "GGUF Q4_K/Q6_K weights are dequantized" in text and "GGUF F16 weights" in text
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method is None
    assert layer.self_attn.o_proj.wq_format == "q4"
    assert layer.self_attn.o_proj.weight_scale.dtype == torch.float16
    # a Q4_1 part and a Q4_K part: one q4 layout with fp32 scales (Q4_K's need them)
    assert layer.mlp.gate_up_proj.wq_format == "q4"
    assert layer.mlp.gate_up_proj.weight_scale.dtype == torch.float32


def test_flags():
    assert keeps_gguf_blocks(None, False, "cpu")
    assert not keeps_gguf_blocks(None, False, "cuda")          # GPUs: only when asked
    assert keeps_gguf_blocks("gguf", False, "cuda")
    assert not keeps_gguf_blocks(None, True, "cpu")
    assert not keeps_gguf_blocks("fp8", False, "cpu")
    assert not keeps_gguf_blocks("awq", False, "cpu")           # quantizes dequantized weights
    with pytest.raises(ValueError, match="choose one"):
        keeps_gguf_blocks("gguf", True, "cpu")


def test_quantization_gguf_needs_a_gguf_file():
    from transformers import LlamaConfig

    from engine.layers.quantization import get_quant_config

    with pytest.raises(ValueError, match="GGUF"):
        get_quant_config(LlamaConfig(), "gguf", "safetensors")


@pytest.mark.slow
def test_embedded_model_weights_identical_to_dequantized_path():
    from engine.loader.loader import load_model

    blocks, _ = load_model(None, dtype="float32", device="cpu", progress=False)
    plain, _ = load_model(None, dtype="float32", device="cpu", progress=False,
                          gguf_dequantize=True)
    plain_mods = dict(plain.named_modules())
    n = 0
    for name, mod in blocks.named_modules():
        if getattr(mod, "quant_method", None) is None:
            continue
        if name != "lm_head_quant":
            assert mod.wq_format == "q4" and mod.weight.dtype == torch.uint8, name
        w = dequant(mod.wq_format, mod.weight, mod.weight_scale,
                    getattr(mod, "weight_min", None))
        ref = plain_mods.get(name, plain.model.embed_tokens).weight
        assert torch.equal(w, ref), name
        n += 1
    # qkv, o, gate_up, down per layer, and the LM head over the embedding's Q8_0 blocks
    assert n == 4 * blocks.model_config.num_layers + 1
    head = blocks.lm_head_quant
    assert head.wq_format == "q8" and head.weight.dtype == torch.int8
    assert torch.equal(dequant("q8", head.weight, head.weight_scale, None),
                       plain.model.embed_tokens.weight)
    assert torch.equal(blocks.model.embed_tokens.weight, plain.model.embed_tokens.weight)


@pytest.mark.slow
def test_embedded_model_greedy_parity_with_dequantized():
    """Four prompts in one batch, 16 greedy tokens each: the same tokens. Log-probs of the
    chosen tokens agree within 2e-4: both paths multiply the same fp32 weights and differ
    only in the order of fp32 sums (measured: <= 3e-5)."""
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):",
               "Write a haiku about the sea.", "1, 2, 3, 4,"]
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    outs = {}
    for name, kw in (("blocks", {}), ("dequantized", {"gguf_dequantize": True})):
        with LLM(None, dtype="float32", **kw) as llm:
            outs[name] = llm.generate(prompts, sp)
    for a, b in zip(outs["blocks"], outs["dequantized"], strict=True):
        assert len(a.token_ids) == 16
        assert a.token_ids == b.token_ids
        assert max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs)) < 2e-4
