"""AWQ and GPTQ 4-bit checkpoints (engine/layers/quantization/int4.py) on the CPU.

The packers here are written from the published bit orders, independently of ferry's
unpackers: AWQ (AutoAWQ's GEMM ``pack``) puts column ``8j + ORDER[i]`` in nibble ``i`` of word
``j`` with ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``, packed along N for ``qweight [K, N/8]`` and
``qzeros [K/G, N/8]``; GPTQ packs ``qweight [K/8, N]`` along K in order and ``qzeros``
along N in order, storing each zero minus one in its v1 format. A tiny random Llama is
quantized here (random codes, zeros and fp16 scales per group), saved with those tensors
and its ``quantization_config``, and loaded by ferry; the reference is the float weight
``(q - z) * s`` computed here, saved as a float checkpoint that HF transformers runs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from moe_helpers import save_char_tokenizer
from safetensors.torch import load_file, save_file

from engine.device import is_accelerator, resolve_device
from engine.layers.linear import QKVLinear, RowParallelLinear
from engine.layers.quantization import get_quant_config, quantization_scope
from engine.layers.quantization.int4 import Int4Config, unpack_awq, unpack_gptq_qweight
from engine.loader.loader import load_model
from kernels.quant.reference import dequant

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
ON_GPU = is_accelerator(resolve_device("auto"))


def gpu_only(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason="needs a GPU")(fn))


LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1,
          "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64,
          "intermediate_size": 128, "max_position_embeddings": 512,
          "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "vocab_size": 300, "torch_dtype": "float16"}


# ---- the reference packers ---------------------------------------------------------------

def _words(nibs: np.ndarray) -> torch.Tensor:
    """``[..., 8]`` values 0..15 (nibble i last) -> int32 ``[...]`` words."""
    w = np.zeros(nibs.shape[:-1], dtype=np.uint32)
    for i in range(8):
        w |= nibs[..., i].astype(np.uint32) << np.uint32(4 * i)
    return torch.from_numpy(w.view(np.int32).copy())


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` -> ``[R, N/8]`` int32, AWQ's interleaved order along N."""
    a = q.numpy().reshape(q.shape[0], -1, 8)
    return _words(a[..., AWQ_ORDER])


def pack_cols(q: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` -> ``[R, N/8]`` int32 along N in order (GPTQ's qzeros)."""
    return _words(q.numpy().reshape(q.shape[0], -1, 8))


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` -> ``[K/8, N]`` int32 along K in order (GPTQ's qweight)."""
    a = q.numpy().reshape(-1, 8, q.shape[1]).transpose(0, 2, 1)
    return _words(a)


def test_packed_words_by_hand():
    """Columns 0..7 holding 0..7: AWQ's word is 0x75316420 (nibbles 0, 2, 4, 6, 1, 3, 5, 7),
    in-order packing 0x76543210; ferry's unpackers give 0..7 back."""
    q = torch.arange(8).view(1, 8)
    assert pack_awq(q).item() == 0x75316420
    assert pack_cols(q).item() == 0x76543210
    assert pack_rows(q.t()).item() == 0x76543210
    assert unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [list(range(8))]
    assert unpack_gptq_qweight(torch.tensor([[0x76543210]], dtype=torch.int32)).view(-1).tolist() \
        == list(range(8))
    top = torch.tensor([[15, 0, 0, 0, 0, 0, 0, 9]])  # nibble 7 >= 8: a negative int32
    assert pack_cols(top).item() < 0
    assert unpack_awq(pack_awq(top)).tolist() == top.tolist()


# ---- a tiny quantized Llama --------------------------------------------------------------

def _quantized(n: int, k: int, group: int, gen: torch.Generator, sym: bool = False):
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(3, 13, (k // group, n), generator=gen)
    if sym:
        z = torch.full_like(z, 8)
    s = (torch.rand(k // group, n, generator=gen) * 0.01 + 0.004).half()
    w = (q - z.repeat_interleave(group, 0)).double() * s.double().repeat_interleave(group, 0)
    return q, z, s, w.t().float()  # w: [N, K], exact in fp32


def write_checkpoints(root, method: str, group: int, fmt: str = "gptq", seed: int = 0,
                      keep_float: tuple[str, ...] = (), act_order: bool = False):
    """An AWQ or GPTQ checkpoint of a random tiny Llama in ``root/quant`` and its float
    twin ``(q - z) * s`` in ``root/float``; returns ``({hf linear name: W [N, K]}, paths)``.
    AWQ parts named in ``keep_float`` stay float (``modules_to_not_convert``). GPTQ with
    ``act_order``: each layer input's group is a random permutation of ``k // group``
    (``g_idx``), shared by the parts that read the same input, as GPTQ's act-order gives."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CONFIG.items()
                                         if k not in ("architectures", "torch_dtype")}))
    with torch.no_grad():  # embeddings and head wide enough that the tokens vary
        hf.model.embed_tokens.weight.normal_(0, 1.0)
        hf.lm_head.weight.normal_(0, 0.3)
    float_sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    for k in [k for k in float_sd if k.endswith(("embed_tokens.weight", "lm_head.weight"))]:
        float_sd[k] = float_sd[k].half().float()  # the same values in both checkpoints
    quant_sd = {k: v.half() for k, v in float_sd.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    ref = {}
    for i in range(CONFIG["num_hidden_layers"]):
        for block, parts in LINEARS.items():
            for part in parts:
                name = f"model.layers.{i}.{block}.{part}"
                n, k = float_sd[f"{name}.weight"].shape
                if part in keep_float:
                    ref[name] = float_sd[f"{name}.weight"]
                    quant_sd[f"{name}.weight"] = ref[name]
                    continue
                q, z, s, w = _quantized(n, k, group, gen, sym=fmt == "sym")
                g_idx = torch.arange(k, dtype=torch.int32) // group
                if act_order:
                    g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(
                        hash((i, block, k)) % 1000))]
                    w = ((q - z[g_idx.long()]).double() * s[g_idx.long()].double()).t().float()
                ref[name] = w
                float_sd[f"{name}.weight"] = w
                del quant_sd[f"{name}.weight"]
                if method == "ct":  # compressed-tensors: codes stored as signed + 8
                    quant_sd[f"{name}.weight_packed"] = pack_cols(q.t())   # [N, K/8]
                    quant_sd[f"{name}.weight_scale"] = s.t().bfloat16().contiguous()
                    quant_sd[f"{name}.weight_shape"] = torch.tensor([n, k])
                    if fmt != "sym":
                        quant_sd[f"{name}.weight_zero_point"] = pack_cols(z).t()  # [N/8, K/G]
                    w = (q - z.repeat_interleave(group, 0)).double().t() * \
                        s.bfloat16().double().t().repeat_interleave(group, 1)
                    ref[name] = float_sd[f"{name}.weight"] = w.float()
                    continue
                if method == "awq":
                    quant_sd[f"{name}.qweight"] = pack_awq(q)
                    quant_sd[f"{name}.qzeros"] = pack_awq(z)
                else:
                    quant_sd[f"{name}.qweight"] = pack_rows(q)
                    quant_sd[f"{name}.qzeros"] = pack_cols(z - (1 if fmt == "gptq" else 0))
                    quant_sd[f"{name}.g_idx"] = g_idx
                quant_sd[f"{name}.scales"] = s
    qc = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
           "version": "gemm", "modules_to_not_convert": list(keep_float)}
          if method == "awq" else
          {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                         "weights": {"type": "int", "num_bits": 4,
                                                     "strategy": "group", "group_size": group,
                                                     "symmetric": fmt == "sym",
                                                     "actorder": None}}},
           "ignore": ["lm_head"]}
          if method == "ct" else
          {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
           "sym": False, "checkpoint_format": fmt})
    paths = {}
    for kind, sd, cfg in (("quant", quant_sd, dict(CONFIG, quantization_config=qc)),
                          ("float", float_sd, dict(CONFIG, torch_dtype="float32"))):
        d = root / kind
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
        save_char_tokenizer(d)
        paths[kind] = str(d)
    return ref, paths


def _layer_weight(layer) -> torch.Tensor:
    return dequant("q4", layer.weight, layer.weight_scale, layer.weight_min)


def _fused_refs(ref: dict, i: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}."
    return {"self_attn.qkv_proj": torch.cat([ref[p + f"self_attn.{x}_proj"] for x in "qkv"]),
            "self_attn.o_proj": ref[p + "self_attn.o_proj"],
            "mlp.gate_up_proj": torch.cat([ref[p + "mlp.gate_proj"], ref[p + "mlp.up_proj"]]),
            "mlp.down_proj": ref[p + "mlp.down_proj"]}


def _greedy_hf(path: str, prompt: list[int], steps: int) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("method,group,fmt", [("awq", 32, None), ("gptq", 64, "gptq"),
                                              ("gptq", 32, "gptq_v2"), ("ct", 32, "sym"),
                                              ("ct", 64, "asym")])
def test_checkpoint_weights_equal_the_reference(tmp_path, method, group, fmt):
    """Every fused layer's dequantized 4-bit weight equals ``(q - z) * s`` bit for bit."""
    ref, paths = write_checkpoints(tmp_path, method, group, fmt or "gptq")
    model, _ = load_model(paths["quant"], device="cpu", dtype="float32", progress=False)
    for i, layer in enumerate(model.model.layers):
        for name, want in _fused_refs(ref, i).items():
            block, proj = name.split(".")
            lin = getattr(getattr(layer, block), proj)
            assert lin.weight.dtype == torch.uint8 and lin.wq_format == "q4"
            assert lin.weight_scale.shape == (want.shape[0], want.shape[1] // group)
            assert torch.equal(_layer_weight(lin), want), (i, name)
    assert model.model.layers[0].mlp.gate_up_proj.wq_path in ("cpu", "torch")


def test_modules_to_not_convert_stay_float(tmp_path):
    """AWQ's ``modules_to_not_convert`` (substrings of module names): those layers load the
    checkpoint's float weights into the run dtype; the others stay 4-bit."""
    ref, paths = write_checkpoints(tmp_path, "awq", 32, keep_float=("down_proj",))
    model, _ = load_model(paths["quant"], device="cpu", dtype="float32", progress=False)
    for i, layer in enumerate(model.model.layers):
        down = layer.mlp.down_proj
        assert down.quant_method is None and down.weight.dtype == torch.float32
        assert torch.equal(down.weight, ref[f"model.layers.{i}.mlp.down_proj"].float())
        assert layer.mlp.gate_up_proj.weight.dtype == torch.uint8


def test_awq_greedy_tokens_equal_hf_on_the_dequantized_model(tmp_path):
    """ferry on the AWQ checkpoint (4-bit layers, C++ kernels at decode, dequantize + GEMM
    at prefill) gives HF transformers' greedy tokens on the float twin."""
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    _, paths = write_checkpoints(tmp_path, "awq", 32)
    prompts = [[5, 17, 99, 4, 250, 31], [7, 8, 9]]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(paths["quant"], cpu_threads=1) as llm:
        assert llm.runner.model.model.layers[1].self_attn.o_proj.weight.dtype == torch.uint8
        got = [list(o.token_ids) for o in llm.generate(prompts, sp)]
    want = [_greedy_hf(paths["float"], p, 8) for p in prompts]
    assert got == want
    assert len({t for toks in got for t in toks}) > 8  # not one repeated token


def test_tensor_parallel_shards_are_the_reference_slices(tmp_path):
    """TP=2 (ranks built in-process): column-parallel q/k/v shards take their rows of the
    unpacked weight, row-parallel o_proj shards their whole groups of K."""
    ref, paths = write_checkpoints(tmp_path, "awq", 32)
    sd = load_file(paths["quant"] + "/model.safetensors")
    cfg = get_quant_config(type("C", (), {"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}})())
    p = "model.layers.0.self_attn."
    for rank in range(2):
        with quantization_scope(cfg):
            qkv = QKVLinear(64, 16, 4, 2, False, torch.float32, tp_size=2, tp_rank=rank)
            o = RowParallelLinear(64, 64, False, torch.float32, tp_size=2, tp_rank=rank)
        for x in "qkv":
            for t in ("qweight", "qzeros", "scales"):
                getattr(qkv, t).weight_loader(getattr(qkv, t), sd[f"{p}{x}_proj.{t}"], x)
        for t in ("qweight", "qzeros", "scales"):
            getattr(o, t).weight_loader(getattr(o, t), sd[f"{p}o_proj.{t}"])
        for lin in (qkv, o):
            lin.quant_method.process_weights_after_loading(lin, "cpu")
        rows = [ref[p + f"{x}_proj"][rank * (32 if x == "q" else 16):][:32 if x == "q" else 16]
                for x in "qkv"]
        assert torch.equal(_layer_weight(qkv), torch.cat(rows))
        assert torch.equal(_layer_weight(o), ref[p + "o_proj"][:, rank * 32:(rank + 1) * 32])


def test_refusals_name_the_field():
    def cfg(**qc):
        return type("C", (), {"quantization_config": qc})()

    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    assert get_quant_config(cfg(**awq)).checkpoint
    assert get_quant_config(cfg(**gptq)).zero_offset == 1
    assert get_quant_config(cfg(**gptq, checkpoint_format="gptq_v2")).zero_offset == 0
    cases = [(dict(awq, bits=8), "bits 8"), (dict(awq, version="gemv"), "version"),
             (dict(awq, zero_point=False), "zero_point"), (dict(awq, group_size=-1),
                                                          "group_size -1"),
             (dict(gptq, bits=3), "bits 3"),
             (dict(gptq, checkpoint_format="marlin"), "checkpoint_format"),
             (dict(gptq, dynamic={"-:.*": {}}), "dynamic"),
             (dict(gptq, group_size=100), "group_size 100")]
    ct_w = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}

    def ct(weights=None, **group):
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": weights or ct_w,
                                        **group}}}

    c = get_quant_config(cfg(**ct()))
    assert (c.method, c.group_size, c.symmetric) == ("compressed-tensors", 128, True)
    assert get_quant_config(cfg(**ct(dict(ct_w, actorder="group")))).act_order
    assert get_quant_config(cfg(**dict(gptq, desc_act=True))).act_order
    cases += [(ct(dict(ct_w, strategy="channel")), "strategy 'channel'"),
              (ct(dict(ct_w, num_bits=8)), "int 8-bit weights"),
              (ct(input_activations={"type": "int", "num_bits": 8}), "input_activations")]
    for qc, words in cases:
        with pytest.raises(ValueError, match=words):
            get_quant_config(cfg(**qc))
    with pytest.raises(ValueError, match="already quantized"):
        get_quant_config(cfg(**awq), quantization="gptq")
    # dummy weights with a checkpoint config: quantized at load in that scheme
    assert not get_quant_config(cfg(**awq), load_format="dummy").checkpoint
    # a row-parallel split that cuts a group of 64 names --tp-size
    with quantization_scope(Int4Config("gptq", 64)), \
            pytest.raises(ValueError, match="--tp-size 2"):
        RowParallelLinear(64, 64, False, torch.float32, tp_size=2, tp_rank=0)


def test_g_idx_without_desc_act_is_refused(tmp_path):
    _, paths = write_checkpoints(tmp_path, "gptq", 32)
    f = paths["quant"] + "/model.safetensors"
    sd = load_file(f)
    sd["model.layers.1.mlp.down_proj.g_idx"] = sd["model.layers.1.mlp.down_proj.g_idx"].flip(0)
    save_file(sd, f)
    with pytest.raises(ValueError, match="down_proj.g_idx.*act-order"):
        load_model(paths["quant"], device="cpu", dtype="float32", progress=False)


def test_act_order_layers_and_greedy_tokens(tmp_path):
    """GPTQ desc_act: every layer's product equals x @ W^T of the reference weights
    ``(q[k] - z[g_idx[k]]) * s[g_idx[k]]``, and greedy tokens equal HF's on the float twin."""
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    ref, paths = write_checkpoints(tmp_path, "gptq", 32, act_order=True)
    model, _ = load_model(paths["quant"], device="cpu", dtype="float32", progress=False)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(model.model.layers):
        for name, want in _fused_refs(ref, i).items():
            block, proj = name.split(".")
            lin = getattr(getattr(layer, block), proj)
            assert lin.wq_perm.shape == (want.shape[1],)
            xi = x[:, :want.shape[1]]
            y = lin.quant_method.apply(lin, xi)
            exact = xi.double() @ want.double().t()
            assert (y.double() - exact).abs().max() <= 1e-5 * exact.abs().max(), (i, name)
    prompts = [[5, 17, 99, 4, 250, 31], [7, 8, 9]]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(paths["quant"], cpu_threads=1) as llm:
        got = [list(o.token_ids) for o in llm.generate(prompts, sp)]
    assert got == [_greedy_hf(paths["float"], p, 8) for p in prompts]
    assert len({t for toks in got for t in toks}) > 8
    # fused parts with different g_idx cannot share one activation order
    f = paths["quant"] + "/model.safetensors"
    sd = load_file(f)
    sd["model.layers.0.self_attn.k_proj.g_idx"] = torch.arange(64, dtype=torch.int32) // 32
    save_file(sd, f)
    with pytest.raises(ValueError, match="_proj.g_idx: the parts of the fused QKVLinear have different"):
        load_model(paths["quant"], device="cpu", dtype="float32", progress=False)
    with quantization_scope(Int4Config("gptq", 32, act_order=True)), \
            pytest.raises(ValueError, match="--tp-size 2: act-order"):
        RowParallelLinear(64, 64, False, torch.float32, tp_size=2, tp_rank=0)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quantize_at_load_with_dummy_weights(tmp_path, method):
    """``--quantization awq|gptq --load-format dummy``: every linear weight is the
    round-to-nearest 4-bit quantization of the same dummy float weight, groups of 128
    (error at most one step, the group's scale, per weight)."""
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIG, hidden_size=128,
                                                            intermediate_size=256)))
    kw = dict(load_format="dummy", device="cpu", dtype="float32", progress=False)
    model, _ = load_model(str(tmp_path), quantization=method, **kw)
    fp, _ = load_model(str(tmp_path), **kw)
    floats = dict(fp.named_modules())
    n = 0
    for name, lin in model.named_modules():
        if getattr(lin, "wq_format", None) != "q4":
            continue
        w, want = _layer_weight(lin), floats[name].weight.float()
        step = lin.weight_scale.repeat_interleave(128, 1)
        assert lin.weight_scale.shape[1] == want.shape[1] // 128
        assert (w - want).abs().le(step * 1.001).all(), name
        assert (w - want).abs().mean() < 0.3 * step.mean(), name  # rounding, not clamping
        if method == "gptq":  # symmetric: every zero is 8
            assert torch.equal(lin.weight_min, -8 * lin.weight_scale), name
        n += 1
    assert n == 2 * 4


def test_bench_latency_with_awq_dummy_weights(tmp_path):
    """The H200 benchmark's command (``bench.bench_latency --quantization awq --load-format
    dummy``) on a tiny config on the CPU: prefill and decode run over 4-bit layers."""
    from bench.bench_latency import main

    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIG, hidden_size=128,
                                                            intermediate_size=256)))
    out = tmp_path / "lat.jsonl"
    main(["--model-path", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
          "--quantization", "awq", "--batch-size", "1", "2", "--input-len", "24",
          "--output-len", "3", "--result-jsonl", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch_size"], r["input_len"]) for r in rows] == [(1, 24), (2, 24)]
    assert all(r["total_latency_s"] > r["prefill_latency_s"] > 0 for r in rows)


@gpu_only
def test_awq_checkpoint_on_the_gpu_matches_hf(tmp_path):
    """The Triton path (split-K decode tiles, larger tiles for prefill) in fp32 on the GPU
    gives HF transformers' greedy tokens on the float twin."""
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    _, paths = write_checkpoints(tmp_path, "awq", 32)
    prompts = [[5, 17, 99, 4, 250, 31], [7, 8, 9]]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(paths["quant"], dtype="float32") as llm:
        lin = llm.runner.model.model.layers[0].mlp.gate_up_proj
        assert lin.wq_path == "triton"
        got = [list(o.token_ids) for o in llm.generate(prompts, sp)]
    assert got == [_greedy_hf(paths["float"], p, 8) for p in prompts]


@gpu_only
@pytest.mark.parametrize("m", [1, 16, 64, 2048])
def test_llama3_8b_shapes_on_the_gpu(m):
    """bf16 activations, the 8B's gate_up and down weights in 4 bits (groups of 128), against
    the fp32 product of the dequantized weights."""
    from engine.layers.quantization.int4 import quantize_rtn
    from kernels.quant.reference import pack_q4
    from kernels.quant.wq_triton import wq_linear

    g = torch.Generator().manual_seed(m)
    for n, k in ((28672, 4096), (4096, 14336)):
        w = torch.randn(n, k, generator=g) * 0.02
        q, s, z = quantize_rtn(w, 128, symmetric=False)
        layout = [t.cuda() for t in (pack_q4(q), s.float(), -s.float() * z.float())]
        x = torch.randn(m, k, generator=g).cuda().bfloat16()
        ref = x.float() @ dequant("q4", *layout).t()
        y = wq_linear(x, "q4", *layout)
        assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_quant_parity_with_4bit_weights(method):
    """``ferry quant-parity --quantization awq|gptq`` on llama-tiny (K = 64: groups of 64 at
    load): the 4-bit model is scored against the float one (KL above 0: the weights did
    change; bounded: they stay close)."""
    from bench.quant_parity import main
    from engine.loader.loader import config_dir

    threads = torch.get_num_threads()
    try:
        rep = main(["--model-path", config_dir("llama-tiny"), "--load-format", "dummy",
                    "--quantization", method, "--steps", "3", "--num-prompts", "2",
                    "--cpu-threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert rep["quantization"] == method and len(rep["rows"]) == 2
    print(f"\nllama-tiny dummy, {method} RTN 4-bit: mean KL {rep['mean_kl']:.3e}, "
          f"top-1 {rep['top1_match']:.2f}")
    assert 1e-6 < rep["mean_kl"] < 1e-2
