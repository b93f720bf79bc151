"""FP8 W8A8 linear layers (engine/layers/quantization) on the CPU.

The reference is written here, independently of torch's fp8 cast: the e4m3 value table is
built from its bit layout, rounding is to nearest with ties to the even mantissa, and the
products are float64 of those values. Checkpoints in both public formats (compressed-tensors,
quant_method "fp8") are written by the tests as small safetensors files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from engine.device import fp8_linear_backend
from engine.layers.linear import (
    MergedColumnLinear,
    QKVLinear,
    RowParallelLinear,
)
from engine.layers.quantization import (
    Fp8Config,
    get_quant_config,
    process_weights_after_loading,
    quantization_scope,
)
from engine.loader import loader
from engine.loader.loader import config_dir, load_model
from engine.loader.weights import iter_dummy_weights, iter_safetensors
from kernels.fp8.reference import quantize_rows

FP8 = torch.float8_e4m3fn
ONLINE = Fp8Config(False, "test")
LINEAR_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- the hand-written reference ---------------------------------------------------------

def _e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative finite e4m3fn values (float64, ascending) and whether each one's
    mantissa is even."""
    vals, even = [], []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
            even.append(m % 2 == 0)
    return torch.tensor(vals, dtype=torch.float64), torch.tensor(even)


TABLE, EVEN = _e4m3_table()


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 ``v`` (|v| <= 448) to the nearest e4m3 value, ties to the even mantissa."""
    a = v.abs().clamp(max=448.0)
    hi = torch.searchsorted(TABLE, a).clamp(max=len(TABLE) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - TABLE[lo], TABLE[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & EVEN[hi])
    return torch.where(pick_hi, TABLE[hi], TABLE[lo]) * v.sign()


def ref_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row quantization as specified: fp32 scale = max(amax, 1e-12) / 448; codes =
    round(x / scale), the quotient in fp32. Returns float64 (codes [M, K], scale [M, 1])."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return round_e4m3((x.float() / scale).double()), scale.double()


def ref_linear(x, codes, w_scale, bias=None) -> torch.Tensor:
    """float64 ``(xq @ Wq^T) * sx * sw^T + b`` (W8A8) for more than ``WEIGHT_ONLY_MAX_M``
    (16) rows of x, and ``(x @ Wq^T) * sw^T + b`` (weight-only) for at most that many."""
    from engine.layers.quantization.fp8 import WEIGHT_ONLY_MAX_M

    if x.shape[0] <= WEIGHT_ONLY_MAX_M:
        xq, sx = x.double(), 1.0
    else:
        xq, sx = ref_quant(x)
    y = (xq @ codes.double().t()) * sx * w_scale.double().view(1, -1)
    return y if bias is None else y + bias.double()


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ---- the quantizer and the layers --------------------------------------------------------

def test_quantize_rows_matches_the_e4m3_definition():
    torch.manual_seed(0)
    x = torch.randn(40, 300)
    x[1] = 0.0                                   # a zero row: scale 1e-12 / 448, codes 0
    x[2, 7] = 900.0                              # an outlier sets the row's scale
    x[3] *= 1e-6                                 # small values: same relative precision
    x[4, :10] = torch.tensor([448.0, -448.0, 1e-30, 0.0, 3.0, -2.5, 7e-3, 1.0, 2.0, 9.0])
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (40, 1)
    codes, scale = ref_quant(x)
    assert torch.equal(s.double(), scale)
    assert torch.equal(q.double(), codes)
    assert torch.equal(q[1].double(), torch.zeros(300, dtype=torch.float64))
    # the round trip is within e4m3's half-ulp (2^-4 relative) of each value
    err = (q.double() * s.double() - x.double()).abs()
    assert bool((err <= x.double().abs() * 2.0 ** -4 + s.double() * 2.0 ** -10).all())


def _make(cls, *args, config=ONLINE, **kw):
    with quantization_scope(config):
        return cls(*args, dtype=torch.float32, tp_size=kw.pop("tp_size", 1),
                   tp_rank=kw.pop("tp_rank", 0), **kw)


def _qkv_parts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(64, 64, generator=g), "k": torch.randn(32, 64, generator=g) * 3,
            "v": torch.randn(32, 64, generator=g) * 0.1}


def test_fp8_layers_reproduce_the_float64_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 64, generator=g)
    parts = _qkv_parts()
    qkv = _make(QKVLinear, 64, 16, 4, 2, bias=True)
    for sid, w in parts.items():
        qkv.weight.weight_loader(qkv.weight, w, sid)
    bias = torch.randn(128, generator=g)
    qkv.bias.data.copy_(bias)
    gate_up = _make(MergedColumnLinear, 64, [96, 96], bias=False)
    gu = [torch.randn(96, 64, generator=g) for _ in range(2)]
    for i, w in enumerate(gu):
        gate_up.weight.weight_loader(gate_up.weight, w, i)
    down = _make(RowParallelLinear, 96, 64, bias=False)
    wd = torch.randn(64, 96, generator=g)
    down.weight.weight_loader(down.weight, wd)
    for layer in (qkv, gate_up, down):
        process_weights_after_loading(layer, "cpu")
        assert layer.weight.dtype == FP8 and layer.fp8_backend == "dequant"
    for layer, ws, b in ((qkv, list(parts.values()), bias), (gate_up, gu, None),
                         (down, [wd], None)):
        q_s = [ref_quant(w) for w in ws]
        codes = torch.cat([c for c, _ in q_s])
        scale = torch.cat([s for _, s in q_s]).view(-1)
        assert torch.equal(layer.weight.double(), codes)      # fused rows, per-part scales
        assert torch.equal(layer.weight_scale.double(), scale)
        for rows in (7, 16, 17, 40):     # weight-only up to 16 rows, W8A8 above
            k_in = layer.input_size
            xin = torch.randn(rows, k_in, generator=g) if rows != 7 or layer is down else x
            y = layer(xin)
            ref = ref_linear(xin, codes, scale, b)
            assert y.dtype == torch.float32 and y.shape == ref.shape
            assert _rel(y, ref) < 1e-5
            # quantized (not a float layer in disguise), but close to the float product
            w_full = torch.cat(ws)
            exact = xin.double() @ w_full.double().t() + (0 if b is None else b.double())
            assert 1e-3 < _rel(y, exact) < 0.1
            if rows == 17:   # the activations are quantized: not the weight-only product
                xq_ref = (xin.double() @ codes.double().t()) * scale.double().view(1, -1)
                xq_ref = xq_ref + (0 if b is None else b.double())
                assert _rel(y, xq_ref) > 1e-4
    assert qkv(torch.empty(0, 64)).shape == (0, 128)
    assert qkv(x.view(7, 1, 64)).shape == (7, 1, 128)


def test_tensor_parallel_shards_keep_the_tp1_rows_and_scales(monkeypatch):
    parts = _qkv_parts()
    # one KV head: replicated on both ranks
    full = _make(QKVLinear, 64, 16, 4, 1, bias=False)
    shards = [_make(QKVLinear, 64, 16, 4, 1, bias=False, tp_size=2, tp_rank=r) for r in (0, 1)]
    parts["k"], parts["v"] = parts["k"][:16], parts["v"][:16]
    for layer in (full, *shards):
        for sid, w in parts.items():
            layer.weight.weight_loader(layer.weight, w, sid)
    q_rows = [slice(0, 32), slice(32, 64)]
    for r, layer in enumerate(shards):
        rows = list(range(q_rows[r].start, q_rows[r].stop)) + list(range(64, 96))
        assert torch.equal(layer.weight.view(torch.uint8), full.weight[rows].view(torch.uint8))
        assert torch.equal(layer.weight_scale, full.weight_scale[rows])
    # row-parallel: columns split, every rank keeps the full row's scale
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g)
    w[:, 50] *= 40  # rank 1's columns hold each row's amax
    down = _make(RowParallelLinear, 96, 64, bias=False)
    ranks = [_make(RowParallelLinear, 96, 64, bias=False, tp_size=2, tp_rank=r) for r in (0, 1)]
    for layer in (down, *ranks):
        layer.weight.weight_loader(layer.weight, w)
        process_weights_after_loading(layer, "cpu")
    for r, layer in enumerate(ranks):
        assert torch.equal(layer.weight_scale, down.weight_scale)
        assert torch.equal(layer.weight.view(torch.uint8),
                           down.weight[:, 48 * r: 48 * (r + 1)].view(torch.uint8))
    x = torch.randn(5, 96, generator=g)
    full_y = down(x)
    part_y = ranks[0](x[:, :48]) + ranks[1](x[:, 48:])  # what the all-reduce sums
    # each rank quantizes its own half of a token: close, not equal
    assert 0 < _rel(part_y, full_y) < 0.05
    # without activation quantization the shards' sum is the TP=1 product exactly
    for layer in (down, *ranks):
        layer.fp8_quantize = lambda t: (t.float(), torch.ones(t.shape[0], 1))
    assert _rel(ranks[0](x[:, :48]) + ranks[1](x[:, 48:]), down(x)) < 1e-6


def test_checkpoint_scales_expand_per_part_and_shard():
    """Per-tensor checkpoint scales of q, k and v land on their rows, on every rank."""
    ckpt = Fp8Config(True, "fp8", "static")
    parts = _qkv_parts()
    quant = {sid: (w / 0.05).clamp(-448, 448).to(FP8) for sid, w in parts.items()}
    scales = {"q": torch.tensor(0.05), "k": torch.tensor([0.5]), "v": torch.tensor(0.002)}
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        layer = _make(QKVLinear, 64, 16, 4, 2, bias=False, config=ckpt, tp_size=tp,
                      tp_rank=rank)
        for sid in "qkv":
            layer.weight.weight_loader(layer.weight, quant[sid], sid)
            layer.weight_scale.weight_loader(layer.weight_scale, scales[sid], sid)
        process_weights_after_loading(layer, "cpu")
        q, kv = 64 // tp, 32 // tp
        expect = torch.cat([torch.full((q,), 0.05), torch.full((kv,), 0.5),
                            torch.full((kv,), 0.002)])
        assert torch.equal(layer.weight_scale, expect)
        with pytest.raises(ValueError, match="says FP8, but a weight is"):
            layer.weight.weight_loader(layer.weight, parts["q"], "q")
    layer.weight_scale.data[0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        process_weights_after_loading(layer, "cpu")


# ---- configs ------------------------------------------------------------------------------

def _cfg(qc=None):
    return SimpleNamespace(quantization_config=qc) if qc else SimpleNamespace()


CT_CHANNEL = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                              "dynamic": True, "symmetric": True}}}}


def _ct(weights=None, acts="keep", **top):
    qc = json.loads(json.dumps(CT_CHANNEL))
    g = qc["config_groups"]["group_0"]
    g["weights"].update(weights or {})
    if acts != "keep":
        g["input_activations"] = acts
    qc.update(top)
    return qc


def test_quant_config_detection_and_refusals():
    assert get_quant_config(_cfg()) is None
    # transformers marks configs read from GGUF files; the loader dequantizes those itself
    assert get_quant_config(_cfg({"quant_method": "gguf"})) is None
    assert get_quant_config(_cfg(CT_CHANNEL), None, "gguf") is None
    assert get_quant_config(_cfg(), "fp8") == Fp8Config(False, "--quantization fp8")
    ct = get_quant_config(_cfg(CT_CHANNEL), "fp8")  # an FP8 checkpoint with the flag is fine
    assert ct.checkpoint_fp8 and ct.source == "compressed-tensors" and ct.ignore == ["lm_head"]
    assert ct.activation_scheme == "dynamic" and ct.is_ignored("lm_head")
    assert not ct.is_ignored("model.layers.0.mlp.down_proj")
    static = get_quant_config(_cfg(_ct({"strategy": "tensor"}, {
        "type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False})))
    assert static.activation_scheme == "static"
    assert get_quant_config(_cfg(_ct(acts=None))).activation_scheme == "none"
    plain = get_quant_config(_cfg({"quant_method": "fp8", "activation_scheme": "static",
                                   "ignored_layers": ["re:.*down_proj"]}))
    assert plain.checkpoint_fp8 and plain.is_ignored("model.layers.3.mlp.down_proj")
    block = get_quant_config(_cfg({"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]}))
    assert block.checkpoint_fp8 and block.weight_block_size == (128, 128)
    # dummy weights of an FP8 config are float: quantized while they load
    assert not get_quant_config(_cfg(CT_CHANNEL), None, "dummy").checkpoint_fp8
    refusals = [
        ({"quant_method": "fp8", "activation_scheme": "dynamic",
          "weight_block_size": [128]}, "weight_block_size \\[128\\]"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "two positive integers"),
        (_ct({"strategy": "block", "block_structure": [128, 128]}), "block-wise FP8"),
        (_ct({"type": "int", "num_bits": 4, "strategy": "group"}), "int 4-bit weights"),
        (_ct({"strategy": "group"}), "weight strategy 'group'"),
        (_ct(acts={"type": "int", "num_bits": 8, "dynamic": True}), "int 8-bit activations"),
        (_ct(format="pack-quantized"), "pack-quantized group .* float 8-bit weights"),
        (_ct(format="marlin-24"), "format 'marlin-24'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e5m2"}, "e5m2"),
    ]
    for qc, msg in refusals:
        with pytest.raises(ValueError, match=msg):
            get_quant_config(_cfg(qc))
    with pytest.raises(ValueError, match="--quantization 'int8' is not supported"):
        get_quant_config(_cfg(), "int8")
    assert fp8_linear_backend("cpu") == "dequant"


# ---- checkpoints --------------------------------------------------------------------------

def _float_checkpoint(d) -> tuple[dict, dict[str, torch.Tensor]]:
    """A tiny untied Llama (vocab 512) and its HF-named float tensors."""
    cfg = json.loads((loader.CONFIGS_DIR / "llama-tiny.json").read_text())
    cfg.update(vocab_size=512, tie_word_embeddings=False)
    os.makedirs(d, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(str(d), load_format="dummy", device="cpu", seed=5, progress=False)
    tensors = {n: t.clone() for n, t in iter_dummy_weights(model, 5, torch.device("cpu"))}
    g = torch.Generator().manual_seed(6)
    for n in tensors:  # distinct magnitudes per part, so per-tensor scales differ
        if n.endswith("_proj.weight"):
            tensors[n] *= float(torch.rand(1, generator=g) * 4 + 0.5)
    return cfg, tensors


def _write(d, cfg: dict, tensors: dict, qc: dict | None) -> str:
    os.makedirs(d, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc}
                                                         if qc else {})}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    return str(d)


def _quantized(tensors, strategy: str, static: bool, scale_shape, skip=()) -> dict:
    """The checkpoint as llm-compressor / AutoFP8 write it: e4m3 weights, their scales,
    static input scales (ignored by ferry)."""
    out = {}
    for n, t in tensors.items():
        part = n.split(".")[-2]
        if part not in LINEAR_PARTS or any(s in n for s in skip):
            out[n] = t
            continue
        if strategy == "channel":
            codes, s = ref_quant(t)
        else:
            s = t.abs().amax().clamp(min=1e-12).view(1, 1) / 448.0
            codes = round_e4m3((t.float() / s).double())
        out[n] = codes.to(FP8)
        out[n + "_scale"] = s.float().reshape(scale_shape(t.shape[0]))
        if static:
            out[n.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])
    return out


def _expected_layers(model, ckpt: dict, skip=()):
    """(layer, fp8 codes [out, in], expanded scale [out]) for every quantized layer."""
    for i, layer in enumerate(model.model.layers):
        for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                             ("self_attn.o_proj", ("o_proj",)),
                             ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
                             ("mlp.down_proj", ("down_proj",))):
            mod = layer.get_submodule(fused)
            names = [f"model.layers.{i}.{fused.split('.')[0]}.{p}.weight" for p in parts]
            if any(s in names[0] for s in skip):
                assert mod.quant_method is None and mod.weight.dtype == torch.float32
                continue
            codes = torch.cat([ckpt[n].double() for n in names])
            scale = torch.cat([ckpt[n + "_scale"].double().reshape(-1).expand(
                ckpt[n].shape[0]) for n in names])
            yield mod, codes, scale


SCHEMES = {
    "compressed-tensors channel, dynamic": (
        CT_CHANNEL, "channel", False, lambda n: (n, 1)),
    "compressed-tensors tensor, static": (
        _ct({"strategy": "tensor"}, {"type": "float", "num_bits": 8, "strategy": "tensor",
                                     "dynamic": False}), "tensor", True, lambda n: (1,)),
    "fp8 static, scalar scales": (
        {"quant_method": "fp8", "activation_scheme": "static"}, "tensor", True, lambda n: ()),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fp8_checkpoints_load_and_reproduce_the_reference(tmp_path, scheme):
    qc, strategy, static, scale_shape = SCHEMES[scheme]
    cfg, tensors = _float_checkpoint(tmp_path / "float")
    ckpt = _quantized(tensors, strategy, static, scale_shape)
    path = _write(tmp_path / "fp8", cfg, ckpt, qc)
    model, _ = load_model(path, device="cpu", progress=False)
    assert model.lm_head.weight.dtype == torch.float32
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7))
    n = 0
    for mod, codes, scale in _expected_layers(model, ckpt):
        assert torch.equal(mod.weight.double(), codes)
        assert torch.equal(mod.weight_scale.double(), scale.float().double())
        xin = x if mod.input_size == 64 else torch.randn(3, mod.input_size)
        assert _rel(mod(xin), ref_linear(xin, codes, scale.float())) < 1e-5
        n += 1
    assert n == 8
    if strategy == "channel":
        # the checkpoint is exactly what --quantization fp8 makes of the float weights
        online, _ = load_model(_write(tmp_path / "bf", cfg, tensors, None), device="cpu",
                               quantization="fp8", progress=False)
        ref = dict(online.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p.view(torch.uint8) if p.dtype == FP8 else p,
                               ref[name].view(torch.uint8) if p.dtype == FP8 else ref[name])
        # safetensors read as lazy slices (tensor-parallel loading) give the same model
        with quantization_scope(get_quant_config(model.config)):
            lazy = type(model)(model.config, torch.float32)
        lazy.load_weights(iter_safetensors([os.path.join(path, "model.safetensors")],
                                           lazy=True))
        lazy_p = dict(lazy.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p.float(), lazy_p[name].float()), name


def test_ignore_lists_missing_scales_and_stray_fp8_tensors(tmp_path):
    cfg, tensors = _float_checkpoint(tmp_path / "float")
    skip = ("layers.1.mlp.down_proj",)
    ckpt = _quantized(tensors, "channel", False, lambda n: (n, 1), skip=skip)
    qc = _ct(ignore=["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"])
    model, _ = load_model(_write(tmp_path / "ign", cfg, ckpt, qc), device="cpu",
                          progress=False)
    assert len(list(_expected_layers(model, ckpt, skip))) == 7
    down = model.model.layers[1].mlp.down_proj
    assert torch.equal(down.weight, tensors["model.layers.1.mlp.down_proj.weight"])
    # a fused layer whose parts are ignored only in part
    with pytest.raises(ValueError, match="keeps only some of"):
        load_model(_write(tmp_path / "part", cfg, ckpt, _ct(ignore=["re:.*q_proj"])),
                   device="cpu", progress=False)
    # a scale missing from the checkpoint
    gone = {k: v for k, v in ckpt.items() if k != "model.layers.0.mlp.up_proj.weight_scale"}
    with pytest.raises(ValueError, match="lacks 1 weights: model.layers.0.mlp.gate_up_proj"
                                         ".weight_scale:1"):
        load_model(_write(tmp_path / "miss", cfg, gone, qc), device="cpu", progress=False)
    # FP8 weights without a quantization_config: their scales would be ignored
    noqc = _write(tmp_path / "noqc", cfg, ckpt, None)
    with pytest.raises(ValueError, match="down_proj.weight is FP8 in the checkpoint, but "
                                         "ferry loads it as float32: FP8 linear weights need"):
        load_model(noqc, device="cpu", progress=False)
    with pytest.raises(ValueError, match="an FP8 weight in a checkpoint without an FP8 "
                                         "quantization_config"):
        load_model(noqc, device="cpu", progress=False, quantization="fp8")
    # an FP8 LM head is refused rather than cast without its scale
    fp8_head = dict(ckpt, **{"lm_head.weight": tensors["lm_head.weight"].to(FP8)})
    with pytest.raises(ValueError, match="lm_head.weight is FP8 in the checkpoint"):
        load_model(_write(tmp_path / "head", cfg, fp8_head, qc), device="cpu", progress=False)


def test_quantization_flag_with_dummy_weights():
    """``--load-format dummy --quantization fp8``: the GPU benchmarks' FP8 weights."""
    a, _ = load_model(config_dir("llama-tiny"), "dummy", device="cpu", quantization="fp8",
                      seed=1, progress=False)
    b, _ = load_model(config_dir("llama-tiny"), "dummy", device="cpu", seed=1, progress=False)
    la, lb = a.model.layers[0].mlp.gate_up_proj, b.model.layers[0].mlp.gate_up_proj
    codes, scale = ref_quant(lb.weight.data)
    assert torch.equal(la.weight.double(), codes)
    assert torch.equal(la.weight_scale.double(), scale.view(-1))
    assert a.model.embed_tokens.weight.dtype == torch.float32
    nbytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in (a, b)]
    assert nbytes[0] < nbytes[1]


def test_triton_quantizer_in_the_interpreter():
    """The GPU activation quantizer's indexing and scales. The interpreter's own fp8 cast
    rounds a value that should round up to a power of two down to the power of two below,
    so here those codes may be half the reference's; tests/engine/test_fp8_gpu.py checks
    every code on a GPU."""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import torch
        from kernels.fp8.reference import quantize_rows
        from kernels.fp8.fp8_triton import quantize_rows_triton
        torch.manual_seed(0)   # unseeded, ~1% of runs drew a value that the interpreter
        # (truncating in e4m3's subnormal range) flushes to 0 where torch rounds to 2^-9
        x = torch.randn(6, 200 * 3)[:, ::3] * 5          # a strided input
        x[2] = 0
        q, s = quantize_rows_triton(x)
        rq, rs = quantize_rows(x)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 1), (q.dtype, s.shape)
        assert torch.equal(s, rs), (s, rs)
        a, b = q.float(), rq.float()
        # the interpreter casts a value that rounds up to a power of two down a binade
        artefact = (a * 2 == b) & (torch.frexp(b)[0].abs() == 0.5)
        assert bool(((a == b) | artefact).all()), (a[(a != b) & ~artefact], b[(a != b)])
        assert float((a == b).float().mean()) > 0.95
        print("ok", float((a == b).float().mean()))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parents[5])
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.fixture
def keep_threads():
    """``ferry quant-parity --cpu-threads`` sets the process's torch threads: restore them."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_quant_parity_command(tmp_path, capsys, keep_threads):
    """``ferry quant-parity`` on a dummy model, and against an FP8 checkpoint of the same
    float weights (channel scales: exactly what --quantization fp8 makes of them)."""
    from bench.quant_parity import main

    rep = main(["--model-path", config_dir("llama-tiny"), "--load-format", "dummy",
                "--steps", "3", "--num-prompts", "2", "--cpu-threads", "1"])
    assert rep["prompts"] == "random" and rep["num_prompts"] == 2 and len(rep["rows"]) == 2
    assert 0 < rep["mean_kl"] < 0.1 and 0 <= rep["top1_match"] <= 1
    assert '"prompts_fully_agreed"' in capsys.readouterr().out
    cfg, tensors = _float_checkpoint(tmp_path / "float")
    fdir = _write(tmp_path / "f", cfg, tensors, None)
    qdir = _write(tmp_path / "q", cfg, _quantized(tensors, "channel", False, lambda n: (n, 1)),
                  CT_CHANNEL)
    args = ["--model-path", fdir, "--steps", "3", "--num-prompts", "2", "--random-prompts",
            "--cpu-threads", "1"]
    online = main(args)
    ckpt = main(args + ["--fp8-model-path", qdir, "--result-json", str(tmp_path / "r.json")])
    assert ckpt["mean_kl"] == online["mean_kl"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == ckpt["rows"]
