"""Block-wise FP8 mixture-of-experts checkpoints (Qwen3-MoE-FP8's format) on the CPU: the
experts' e4m3 weights and per-block ``weight_scale_inv`` stacked by ferry
(``engine.layers.moe_fp8``), the attention as block-FP8 linear layers, the router float.

A tiny random Qwen3-MoE (8 experts, top-2, 128 x 128 blocks; the experts' intermediate size
192 is 1.5 blocks, so the up rows start inside a block and the down projection's K ends in a
partial one) is saved by HF, quantized here with the reference quantizer of
``test_fp8_block`` and loaded by ferry; HF runs the dequantized twin. The experts are
weight-only at every M, the attention W8A8 above 16 rows (HF's q/k/v/o inputs quantized the
same way there, :class:`test_fp8_block.QuantizedPrefill`).
"""

from __future__ import annotations

import json

import pytest
import torch
from moe_helpers import save_char_tokenizer
from parity_helpers import (
    NEW_TOKENS,
    SP,
    assert_matches_hf,
    hf_greedy,
    hf_references,
    parity_llm,
    seeded_prompts,
)
from safetensors.torch import load_file, save_file
from test_fp8_block import QuantizedPrefill, dequantize, gpu_only, quantize_blocks

from engine.loader.loader import load_model

pytestmark = pytest.mark.slow

BLOCK = (128, 128)
CONFIG = {"vocab_size": 256, "hidden_size": 256, "num_attention_heads": 2,
          "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
          "intermediate_size": 256, "moe_intermediate_size": 192, "num_experts": 8,
          "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 512,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
          "tie_word_embeddings": False, "attn_implementation": "eager"}
QUANTIZED = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
             "_proj.weight")   # the last: every expert's gate/up/down


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(quantized checkpoint dir, HF model on the dequantized weights)."""
    import transformers as T

    root = tmp_path_factory.mktemp("qwen3moe_fp8")
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(T.Qwen3MoeConfig(**CONFIG), dtype=torch.float32)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.06 * noise)
    hf.save_pretrained(root / "float")
    hf, deq = _save_block_fp8(root, _qwen_is_quantized, BLOCK, boost=True)
    return root, hf, deq


def _qwen_is_quantized(name: str) -> bool:
    return ".layers." in name and name.endswith(QUANTIZED) and ".mlp.gate." not in name


def _save_block_fp8(root, is_quantized, block: tuple[int, int], boost: bool = False):
    """Quantize the float checkpoint in ``root / "float"``: each tensor ``is_quantized``
    names to e4m3 codes + ``weight_scale_inv`` per ``block`` (its top-left 64 x 64 scaled
    by 4 first when ``boost``: blocks of different scales), saved in ``root`` with the
    block-FP8 ``quantization_config`` and a tokenizer; the float checkpoint is overwritten
    with the dequantized twin. Returns ``(HF model on the twin, {name: twin tensor})``."""
    import transformers as T

    sd = load_file(str(root / "float" / "model.safetensors"))
    quant, deq = {}, {}
    for name, t in sd.items():
        if is_quantized(name):
            if boost:
                t = t.clone()
                t[:64, :64] *= 4
            codes, scale = quantize_blocks(t, *block)
            quant[name], quant[name + "_scale_inv"] = codes, scale
            deq[name] = dequantize(codes, scale, *block)
        else:
            quant[name] = deq[name] = t
    save_file(deq, str(root / "float" / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in quant.items()}, str(root / "model.safetensors"))
    cfg = json.loads((root / "float" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (root / "config.json").write_text(json.dumps(cfg))
    save_char_tokenizer(root)
    hf = T.AutoModelForCausalLM.from_pretrained(root / "float", dtype=torch.float32).eval()
    return hf, deq


def _assert_alone_match_hf(root, hf, quantized_prefill, what: str) -> None:
    """The seeded prompts of 5, 13 and 40 tokens, each alone, 12 greedy steps: the short
    ones against plain HF, the 40-token one against HF within ``quantized_prefill``; and
    more than 8 distinct tokens in all (not one repeated token)."""
    prompts = seeded_prompts()
    refs = hf_references(hf, prompts[:2])
    with quantized_prefill:
        refs.append(hf_greedy(hf, prompts[2]))
    with parity_llm(root, max_total_tokens=2048) as llm:
        outs = [llm.generate([p], SP)[0] for p in prompts]
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_matches_hf(out, ref, f"{what}, prompt {i}")
    assert len({t for o in outs for t in o.token_ids}) > 8


def test_experts_keep_e4m3_with_their_block_scales(checkpoint):
    """The stacked experts are e4m3; their dequantization is the reference's exactly (w13's
    scales per row: the up rows start inside a block; w2's folded per block); the router is
    float."""
    from kernels.moe.reference import dequantize_fp8_block_experts

    root, _, deq = checkpoint
    model, _ = load_model(str(root), device="cpu", dtype="float32", progress=False)
    moe = model.model.layers[1].mlp
    ex = moe.experts
    assert ex.w13_weight.dtype == ex.w2_weight.dtype == torch.float8_e4m3fn
    assert moe.gate.weight.dtype == torch.float32 and moe.gate.quant_method is None
    assert ex.fp8_experts.row_div == {"w13": 1, "w2": 128}
    p = "model.layers.1.mlp.experts"
    want13 = torch.stack([torch.cat([deq[f"{p}.{e}.gate_proj.weight"],
                                     deq[f"{p}.{e}.up_proj.weight"]]) for e in range(8)])
    want2 = torch.stack([deq[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    got13 = dequantize_fp8_block_experts(ex.w13_weight, ex.w13_weight_scale_inv, 128, 1)
    got2 = dequantize_fp8_block_experts(ex.w2_weight, ex.w2_weight_scale_inv, 128, 128)
    assert torch.equal(got13, want13) and torch.equal(got2, want2)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn


def test_greedy_tokens_and_logprobs_match_hf(checkpoint):
    """12 greedy steps, tokens equal and log-probs within 1e-3: the short prompts alone
    against plain HF, the 40-token prompt alone against HF with its attention inputs
    quantized in the prefill."""
    root, hf, _ = checkpoint
    _assert_alone_match_hf(root, hf, QuantizedPrefill(hf, BLOCK[1]), "qwen3-moe block FP8")


def test_dummy_block_fp8_moe_and_refusals(tmp_path):
    """``--load-format dummy`` with the block-FP8 config draws e4m3 experts with folded
    scales; a TP split that cuts the experts' blocks, and per-channel FP8 experts
    (``--quantization fp8`` on a float MoE checkpoint), are refused in one line."""
    import transformers as T

    from engine.layers.moe import ExpertOptions, FusedMoE

    cfg = T.Qwen3MoeConfig(**{**CONFIG, "moe_intermediate_size": 256}).to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(str(tmp_path), load_format="dummy", device="cpu", dtype="float32",
                          progress=False)
    ex = model.model.layers[0].mlp.experts
    assert ex.w13_weight.dtype == torch.float8_e4m3fn
    assert ex.fp8_experts.row_div == {"w13": 128, "w2": 128}
    assert ex.w13_weight_scale_inv.shape == (8, 4, 2)
    with pytest.raises(ValueError, match="--tp-size 2 gives each rank 96 .* whole 128x128"):
        FusedMoE(8, 2, 256, 192, True, torch.float32, tp_size=2, tp_rank=0, ep_size=1,
                 options=ExpertOptions(fp8_block=(128, 128)))
    del cfg["quantization_config"]
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FP8 and 4-bit expert weights are future work"):
        load_model(str(tmp_path / "f"), load_format="dummy", device="meta", quantization="fp8")


# ---- DeepSeek-V3 ---------------------------------------------------------------------------

DS_BLOCK = (32, 32)


def _is_quantized(name: str) -> bool:
    return ".layers." in name and ".mlp.gate." not in name and \
        name.endswith(("_proj.weight", "kv_a_proj_with_mqa.weight"))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 (``deepseek_helpers``: MLA with low-rank q, grouped sigmoid
    routing, shared experts, a dense first layer) with every linear weight of its layers in
    32 x 32 block FP8 (DeepSeek-V3's checkpoint layout), and HF on the dequantized twin."""
    from deepseek_helpers import save_tiny

    root = tmp_path_factory.mktemp("dsv3_fp8")
    save_tiny("v3", root / "float")
    hf, deq = _save_block_fp8(root, _is_quantized, DS_BLOCK)
    return root, hf, deq


class _NotKvB(QuantizedPrefill):
    """HF's linear inputs quantized in the prefill, but ``kv_b_proj``'s (a float layer in
    ferry: MLA's absorbed form reads its weight)."""

    def __enter__(self):
        for name, mod in self.hf.model.layers.named_modules():
            if isinstance(mod, torch.nn.Linear) and not name.endswith("kv_b_proj"):
                self.handles.append(mod.register_forward_pre_hook(self._hook))
        return self


def test_deepseek_v3_block_fp8_matches_hf(deepseek):
    """The layers keep e4m3 weights (MLA's projections but ``kv_b_proj``, dequantized after
    loading; the dense MLP, the shared and routed experts); 12 greedy steps match HF on the
    dequantized twin within 1e-3, the short prompts weight-only, the 40-token prompt with
    the linear inputs of its prefill quantized (:class:`_NotKvB`)."""
    root, hf, deq = deepseek
    model, _ = load_model(str(root), device="cpu", dtype="float32", progress=False)
    attn = model.model.layers[1].self_attn
    assert attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.quant_method is None
    assert torch.equal(attn.kv_b_proj.weight, deq["model.layers.1.self_attn.kv_b_proj.weight"])
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    moe = model.model.layers[1].mlp
    assert moe.experts.w13_weight.dtype == torch.float8_e4m3fn
    assert moe.shared_experts.down_proj.weight.dtype == torch.float8_e4m3fn
    _assert_alone_match_hf(root, hf, _NotKvB(hf, DS_BLOCK[1]), "DeepSeek-V3 block FP8")


@gpu_only
def test_qwen3_moe_block_fp8_on_the_gpu_matches_hf(checkpoint):
    """The Triton block-FP8 fused MoE and linear layers in float32 on the GPU: the short
    prompts match plain HF within 1e-3 (weight-only everywhere), the 40-token prompt HF
    with its attention inputs quantized (tokens equal, log-probs within 5e-3: Triton's
    quantizer may round a few codes the other way); bf16 runs."""
    from engine.llm import LLM

    root, hf, _ = checkpoint
    prompts = seeded_prompts()
    refs = hf_references(hf, prompts[:2])
    with QuantizedPrefill(hf, BLOCK[1]):
        refs.append(hf_greedy(hf, prompts[2]))
    with LLM(str(root), dtype="float32") as llm:
        ex = llm.runner.model.model.layers[0].mlp.experts
        assert ex.fp8_experts.kernel is not None and ex.w13_weight.device.type != "cpu"
        outs = [llm.generate([p], SP)[0] for p in prompts]
    for i in range(3):
        assert_matches_hf(outs[i], refs[i], f"qwen3-moe block FP8 on the GPU, prompt {i}",
                          tol=1e-3 if i < 2 else 5e-3)
    with LLM(str(root), dtype="bfloat16") as llm:
        assert all(len(o.token_ids) == NEW_TOKENS for o in llm.generate(prompts, SP))
