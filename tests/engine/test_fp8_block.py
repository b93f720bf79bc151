"""Block-wise FP8 checkpoints (``quant_method: fp8`` with ``weight_block_size``, the format of
DeepSeek-V3 and the Qwen3 ``-FP8`` models) on the CPU.

A tiny random Llama and Qwen3 are quantized here with a quantizer written from the published
scheme (per block of ``bn x bk`` weights: ``scale_inv = amax / 448``, codes ``w / scale_inv``
rounded to e4m3; :func:`quantize_blocks`, a loop over blocks independent of ferry's), saved
as e4m3 ``weight`` + float32 ``weight_scale_inv`` with their ``quantization_config``, and
loaded by ferry. The reference is HF transformers running the dequantized weights
(``codes * scale_inv``) in float32. The Llama takes DeepSeek's 128 x 128 blocks (every fused
part starts on a block); the Qwen3 96 x 64 blocks, so its fused q/k/v and gate/up parts start
inside a block (scales kept per row) and its last blocks are partial.
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

from engine.device import is_accelerator, resolve_device
from engine.layers.linear import MergedColumnLinear, QKVLinear, RowParallelLinear
from engine.layers.quantization import Fp8Config, quantization_scope
from engine.loader.loader import load_model
from kernels.fp8.reference import dequantize_weight_blocks

pytestmark = pytest.mark.slow
ON_GPU = is_accelerator(resolve_device("auto"))


def gpu_only(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs a GPU")(fn))


COMMON = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 384,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "num_hidden_layers": 2, "max_position_embeddings": 512, "bos_token_id": 1,
          "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
          "rms_norm_eps": 1e-6, "attn_implementation": "eager"}
CASES = {"llama": (128, 128), "qwen3": (96, 64)}
#: the Llama: 2 heads of 128 (q, k, v 256 rows each: 128 per rank at TP=2); the Qwen3: 4
#: heads of 64, gate and up 352 rows (3.7 blocks of 96), down 352 columns (5.5 blocks of 64)
SHAPES = {"llama": {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128},
          "qwen3": {"intermediate_size": 352}}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The published scheme, block by block: ``(codes [N, K] e4m3, scale_inv [ceil(N/bn),
    ceil(K/bk)] fp32)`` with ``scale_inv = amax(|block|) / 448``."""
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            codes[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = \
                (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = codes.shape
    s = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return codes.float() * s


def write_checkpoint(root, case: str):
    """The block-FP8 checkpoint of a random tiny ``case`` in ``root``; returns
    ``(HF model on the dequantized weights, {HF linear name: dequantized W [N, K]})``."""
    import transformers as T

    bn, bk = CASES[case]
    cfg = (T.LlamaConfig if case == "llama" else T.Qwen3Config)(**{**COMMON, **SHAPES[case]})
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(99)
    quant_sd, ref = {}, {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.06 * noise)
            if name.endswith(tuple(f"{lin}.weight" for lin in LINEARS)):
                p[: bn // 2, : bk // 2] *= 4          # blocks of different scales
                codes, scale = quantize_blocks(p, bn, bk)
                p.copy_(dequantize(codes, scale, bn, bk))
                base = name.removesuffix(".weight")
                quant_sd[name], quant_sd[f"{base}.weight_scale_inv"] = codes, scale
                ref[base] = p.detach().clone()
            else:
                quant_sd[name] = p.detach().clone()
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [bn, bk]}
    (root / "config.json").write_text(json.dumps(dict(cfg.to_dict(), quantization_config=qc)))
    save_file({k: v.contiguous() for k, v in quant_sd.items()}, str(root / "model.safetensors"))
    save_char_tokenizer(root)
    return hf, ref


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf, ref = write_checkpoint(root, request.param)
    return request.param, root, hf, ref


def _lin(model, i: int, name: str):
    block, proj = name.split(".")
    return getattr(getattr(model.model.layers[i], block), proj)


def test_loaded_weights_dequantize_to_the_reference(checkpoint):
    """Every fused layer keeps e4m3 weights whose block dequantization is the reference
    exactly: scales folded to one row per block when the parts start on blocks (Llama),
    one per weight row otherwise (Qwen3's q/k/v and gate/up)."""
    case, root, _, ref = checkpoint
    bn, bk = CASES[case]
    model, _ = load_model(str(root), device="cpu", dtype="float32", progress=False)
    for i in range(COMMON["num_hidden_layers"]):
        for fused, parts in FUSED.items():
            lin = _lin(model, i, fused)
            want = torch.cat([ref[f"model.layers.{i}.{p}"] for p in parts])
            assert lin.weight.dtype == torch.float8_e4m3fn
            aligned = case == "llama" or len(parts) == 1
            assert lin.fp8_scale_row_div == (bn if aligned else 1), (case, fused)
            got = dequantize_weight_blocks(lin.weight, lin.weight_scale_inv, bk,
                                           lin.fp8_scale_row_div)
            assert torch.equal(got, want), (case, i, fused)
            assert torch.equal(lin.fp8_weight_upcast, want)


def quantize_act_groups(x: torch.Tensor, bk: int) -> torch.Tensor:
    """The published activation scheme, group by group: each token's ``bk`` columns
    quantized to e4m3 with ``scale = amax / 448``; returns the dequantized activations."""
    out = torch.empty_like(x, dtype=torch.float32)
    for j in range(0, x.shape[-1], bk):
        g = x[..., j:j + bk].float()
        s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
        out[..., j:j + bk] = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return out


class QuantizedPrefill:
    """Within this block, HF's decoder linear layers quantize their inputs per token per
    ``bk`` columns when a forward has more than ``rows`` rows: 16 is ferry's rule for a
    prompt prefilled alone; 1 for prompts prefilled together in one batch of more than 16
    tokens (HF runs them one at a time, and its decode steps have one row)."""

    def __init__(self, hf, bk: int, rows: int = 16):
        self.hf, self.bk, self.rows, self.handles = hf, bk, rows, []

    def _hook(self, module, args):
        x = args[0]
        if x.reshape(-1, x.shape[-1]).shape[0] > self.rows:
            return (quantize_act_groups(x, self.bk).to(x.dtype),)
        return None

    def __enter__(self):
        for mod in self.hf.model.layers.modules():
            if isinstance(mod, torch.nn.Linear):
                self.handles.append(mod.register_forward_pre_hook(self._hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def test_greedy_tokens_and_logprobs_match_hf_on_the_dequantized_model(checkpoint):
    """ferry serving the block-FP8 checkpoint vs HF on its dequantized weights, 12 greedy
    steps, tokens equal and log-probs within 1e-3. Matmuls of at most 16 rows are
    weight-only: the 5- and 13-token prompts alone match plain HF. Larger ones are W8A8
    (activations quantized per token per ``bk`` columns): the 40-token prompt alone, and all
    three prefilled in one batch, match HF with its linear inputs quantized the same way
    in those forwards (:class:`QuantizedPrefill`); the W8A8 prefill is not the weight-only
    one (plain HF's tokens or log-probs differ)."""
    case, root, hf, _ = checkpoint
    bk = CASES[case][1]
    prompts = seeded_prompts()
    plain = hf_references(hf, prompts)
    with QuantizedPrefill(hf, bk):
        w8a8_alone = hf_greedy(hf, prompts[2])
    with QuantizedPrefill(hf, bk, rows=1):
        w8a8_batch = hf_references(hf, prompts)
    with parity_llm(root, max_total_tokens=2048) as llm:
        assert _lin(llm.runner.model, 0, "mlp.down_proj").weight.dtype == torch.float8_e4m3fn
        alone = [llm.generate([p], SP)[0] for p in prompts]
        assert llm.scheduler.flush_cache()
        batch = llm.generate(prompts, SP)
    for i in range(2):
        assert_matches_hf(alone[i], plain[i], f"{case} prompt {i} alone (weight-only)")
    assert_matches_hf(alone[2], w8a8_alone, f"{case} 40-token prompt alone (W8A8 prefill)")
    for i, out in enumerate(batch):
        assert_matches_hf(out, w8a8_batch[i], f"{case} prompt {i} in a batch (W8A8 prefill)")
    toks, lps = plain[2]
    assert alone[2].token_ids != toks or \
        max(abs(e[0] - b) for e, b in zip(alone[2].logprobs, lps)) > 1e-3
    assert len({t for o in batch for t in o.token_ids}) > 8   # not one repeated token


def test_tensor_parallel_shards_keep_their_blocks(checkpoint):
    """TP=2 (ranks built in-process): the column-parallel q/k/v and gate/up shards and the
    row-parallel o_proj/down_proj shards dequantize to the reference's slices."""
    case, root, _, ref = checkpoint
    if case != "llama":
        pytest.skip("Qwen3's 96-row blocks do not split over 2 ranks (refused, below)")
    bn, bk = CASES[case]
    sd = load_file(str(root / "model.safetensors"))
    cfg = Fp8Config(True, "fp8", weight_block_size=(bn, bk))
    p = "model.layers.1."
    h, inter = COMMON["hidden_size"], COMMON["intermediate_size"]
    for rank in range(2):
        with quantization_scope(cfg):
            qkv = QKVLinear(h, 128, 2, 2, False, torch.float32, tp_size=2, tp_rank=rank)
            o = RowParallelLinear(h, h, False, torch.float32, tp_size=2, tp_rank=rank)
        for lin, parts in ((qkv, "qkv"), (o, [None])):
            for x in parts:
                name = f"{p}self_attn.{x or 'o'}_proj"
                for t in ("weight", "weight_scale_inv"):
                    param = getattr(lin, t)
                    param.weight_loader(param, sd[f"{name}.{t}"], x)
            lin.quant_method.process_weights_after_loading(lin, "cpu")
        rows = [ref[f"{p}self_attn.{x}_proj"][rank * 128:(rank + 1) * 128] for x in "qkv"]
        assert torch.equal(qkv.fp8_weight_upcast, torch.cat(rows))
        assert torch.equal(o.fp8_weight_upcast, ref[f"{p}self_attn.o_proj"][:, rank * 128:][:, :128])
    with quantization_scope(cfg), pytest.raises(ValueError, match="--tp-size 2 .* blocks of 128"):
        MergedColumnLinear(h, [inter, inter], False, torch.float32, tp_size=2, tp_rank=0)


def test_splits_off_the_blocks_are_refused():
    """A row-parallel rank's K or a column-parallel part's rows cut inside a block: one
    line naming --tp-size."""
    cfg = Fp8Config(True, "fp8", weight_block_size=(128, 128))
    with quantization_scope(cfg):
        with pytest.raises(ValueError, match=r"--tp-size 4 gives each rank 64 input columns"):
            RowParallelLinear(256, 256, False, torch.float32, tp_size=4, tp_rank=0)
        with pytest.raises(ValueError, match=r"--tp-size 2 gives each rank 64 rows"):
            QKVLinear(256, 64, 4, 2, False, torch.float32, tp_size=2, tp_rank=1)
        RowParallelLinear(512, 256, False, torch.float32, tp_size=4, tp_rank=3)  # 128 each


def test_dummy_weights_are_drawn_as_block_fp8(tmp_path):
    """``--load-format dummy`` with a config carrying ``weight_block_size``: the dummy float
    weights are quantized per block as they load (e4m3 weights, folded scales), each within
    half an e4m3 step of the float model's weight, and ``bench_latency`` runs on them."""
    import transformers as T

    from bench.bench_latency import main

    cfg = T.Qwen3Config(**COMMON).to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kw = dict(load_format="dummy", device="cpu", dtype="float32", progress=False)
    model, _ = load_model(str(tmp_path), **kw)
    floats = {}
    del cfg["quantization_config"]
    (tmp_path / "float").mkdir()
    (tmp_path / "float" / "config.json").write_text(json.dumps(cfg))
    fp, _ = load_model(str(tmp_path / "float"), **kw)
    floats = dict(fp.named_modules())
    n = 0
    for name, lin in model.named_modules():
        if getattr(lin, "fp8_scale_row_div", None) is None:
            continue
        assert lin.weight.dtype == torch.float8_e4m3fn and lin.fp8_scale_row_div == 128
        want = floats[name].weight
        step = dequantize_weight_blocks(torch.ones_like(lin.weight, dtype=torch.float32),
                                        lin.weight_scale_inv, 128, 128) * 32
        assert ((lin.fp8_weight_upcast - want).abs() <= step / 2).all(), name
        n += 1
    assert n == 2 * 4
    out = tmp_path / "lat.jsonl"
    main(["--model-path", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
          "--quantization", "fp8", "--batch-size", "1", "--input-len", "24",
          "--output-len", "3", "--result-jsonl", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and rows[0]["total_latency_s"] > rows[0]["prefill_latency_s"] > 0


@gpu_only
def test_checkpoint_on_the_gpu_matches_hf(checkpoint):
    """The Triton path (weight-only split-K at <= 16 rows, the activation quantizer and the
    e4m3 dot above) in float32 on the GPU: the same comparisons as on the CPU (the W8A8
    prefill within 5e-3: Triton's quantizer may round a few codes the other way); then bf16
    runs through the same kernels."""
    from engine.llm import LLM

    case, root, hf, _ = checkpoint
    bk = CASES[case][1]
    prompts = seeded_prompts()
    plain = hf_references(hf, prompts[:2])
    with QuantizedPrefill(hf, bk):
        w8a8 = hf_greedy(hf, prompts[2])
    with LLM(str(root), dtype="float32") as llm:
        lin = _lin(llm.runner.model, 0, "mlp.gate_up_proj")
        assert lin.fp8_block_kernel is not None and lin.weight.device.type != "cpu"
        alone = [llm.generate([p], SP)[0] for p in prompts]
    for i in range(2):
        assert_matches_hf(alone[i], plain[i], f"{case} prompt {i} on the GPU (weight-only)")
    assert_matches_hf(alone[2], w8a8, f"{case} 40-token prompt on the GPU (W8A8)",
                      tol=5e-3)
    with LLM(str(root), dtype="bfloat16") as llm:
        outs = llm.generate(prompts, SP)
    assert all(len(o.token_ids) == NEW_TOKENS and all(abs(e[0]) < 1e3 for e in o.logprobs)
               for o in outs)


def _tp_run(path: str, tp: int):
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    prompts = [[(7 * i + 3) % 250 + 3 for i in range(40)], [11, 12, 13]]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    with LLM(path, load_format="dummy", tp_size=tp, cpu_threads=1, seed=3) as llm:
        lin = llm.runner.model.model.layers[0].self_attn.o_proj
        assert lin.weight.dtype == torch.float8_e4m3fn and lin.tp_size == tp
        assert lin.weight_scale_inv.shape == (2, 2 // tp)   # folded: 2 x 2 blocks, K split
        outs = llm.generate(prompts, sp)
    return [list(o.token_ids) for o in outs], [e[0] for o in outs for e in o.logprobs]


def test_tp2_matches_tp1_with_dummy_block_fp8_weights(tmp_path):
    """TP=2 (gloo) against TP=1 on dummy weights drawn as 128 x 128 block FP8: each rank
    holds whole blocks, and a row-parallel rank's activation groups are the TP=1 groups
    (quantized per 128 columns, none crosses a rank), so only the all-reduce's order of
    sums differs: tokens equal, log-probs within 1e-3."""
    import transformers as T

    cfg = T.LlamaConfig(**{**COMMON, **SHAPES["llama"], "intermediate_size": 512}).to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_char_tokenizer(tmp_path)
    ref_toks, ref_lps = _tp_run(str(tmp_path), 1)
    got_toks, got_lps = _tp_run(str(tmp_path), 2)
    assert got_toks == ref_toks
    worst = max(abs(a - b) for a, b in zip(got_lps, ref_lps))
    assert worst < 1e-3, f"TP=2 vs TP=1 log-prob difference {worst:.2e}"
