"""``engine.layers.select_ops``: fused or eager small ops, chosen once per model.

The fused model here lives on the test device, which on a CPU-only machine is the CPU with
the Triton interpreter: the old per-call check (``x.device.type != "cpu"``) would have run
eager ops there, so the fused kernels running at all shows that nothing looks at the device
per call. The fused model's pieces (everything between attention calls: norms with the
residual add, q/k norm, rotary, SiLU-and-mul) must match the eager model's.
"""

from __future__ import annotations

import json

import pytest
import torch
from kernel_test_utils import DEVICE, assert_close

from engine.layers import select_ops
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.loader.loader import load_model
from kernels import cpu_ops, fused_ops, reference, rotary

# Qwen3-style: q_norm/k_norm, so every small op appears; head_dim 32 != hidden / heads
_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
           "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "vocab_size": 128, "tie_word_embeddings": False}
# per layer: input, post-attention, q and k norms + the MLP activation; final norm; rope
_NUM_OPS = 2 * 5 + 1 + 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3-tiny")
    (d / "config.json").write_text(json.dumps(_CONFIG))
    return str(d)


def _load(model_dir):
    model, _ = load_model(model_dir, load_format="dummy", dtype="float32", device=DEVICE,
                          seed=3, progress=False)
    return model


def _impls(model) -> dict:
    """``{module name: impl}`` of the small-op modules."""
    return {n: m.impl for n, m in model.named_modules()
            if isinstance(m, RMSNorm | SiluAndMul | RotaryEmbedding)}


FUSED = {RMSNorm: fused_ops.rms_norm, SiluAndMul: fused_ops.silu_and_mul,
         RotaryEmbedding: rotary.rotary_inplace}
EAGER = {RMSNorm: reference.rms_norm_ref, SiluAndMul: reference.silu_and_mul_ref,
         RotaryEmbedding: reference.rotary_ref}
CPU = {RMSNorm: cpu_ops.rms_norm, SiluAndMul: cpu_ops.silu_and_mul,
       RotaryEmbedding: cpu_ops.rotary_inplace}


def _assert_chosen(model, table):
    mods = [m for m in model.modules() if isinstance(m, tuple(table))]
    assert len(mods) == _NUM_OPS
    for m in mods:
        want = table[type(m)]
        # the conftest may reload the kernel modules: compare by qualified name and module
        assert (m.impl.__module__, m.impl.__qualname__) == (want.__module__, want.__qualname__)


def test_select_ops_sets_each_model_once(model_dir):
    fused_model, eager_model = _load(model_dir), _load(model_dir)
    _assert_chosen(eager_model, EAGER)                   # the default, before any selection
    assert select_ops(fused_model, True) == _NUM_OPS
    _assert_chosen(fused_model, FUSED)
    _assert_chosen(eager_model, EAGER)                   # per model: the other is untouched
    later = _load(model_dir)
    _assert_chosen(later, EAGER)                         # no process-wide switch left behind
    assert select_ops(fused_model, False) == _NUM_OPS
    _assert_chosen(fused_model, EAGER)
    assert select_ops(torch.nn.Linear(2, 2), True) == 0


def test_fused_model_pieces_match_eager(model_dir):
    fused_model, eager_model = _load(model_dir), _load(model_dir)
    select_ops(fused_model, True)
    select_ops(eager_model, False)
    assert len(set(_impls(fused_model).values()) & set(_impls(eager_model).values())) == 0
    t = 5
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, _CONFIG["vocab_size"], (t,), generator=g).to(DEVICE)
    pos = torch.tensor([0, 1, 2, 17, 127], device=DEVICE)
    attn_out = torch.randn(t, 4 * 32, generator=g).to(DEVICE)
    with torch.inference_mode():
        outs = []
        for model in (fused_model, eager_model):
            inner = model.model
            q, k, v, res = inner.piece(0, pos, input_ids=ids)   # norm, qk norm, rotary
            q1, k1, v1, res1 = inner.piece(1, pos, attn_out=attn_out, residual=res)
            final = inner.piece(2, pos, attn_out=attn_out, residual=res1)   # MLP, final norm
            outs.append((q, k, v, res, q1, k1, res1, final))
    names = ("q0", "k0", "v0", "residual0", "q1", "k1", "residual1", "final hidden")
    for name, got, want in zip(names, *outs):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert_close(got, want, torch.float32, name)


def test_model_runner_selects_from_device_and_flag(monkeypatch):
    """``ModelRunner`` selects once from its device and ``--disable-fused-ops``: the C++
    kernels on the CPU (eager where they do not build, and with ``--disable-fused-ops``);
    fused on a Triton device (here the GPU, or the CPU pretending to be one under the
    interpreter), and eager there too with ``--disable-fused-ops``."""
    from engine import device as dev
    from engine.args import ServerArgs
    from engine.executor.model_runner import ModelRunner
    from engine.loader.loader import config_dir

    def chosen(device: str, **kw) -> dict:
        args = ServerArgs(model_path=config_dir("llama-tiny"), load_format="dummy",
                          device=device, dtype="float32", max_total_tokens=256,
                          max_running_requests=2, disable_cuda_graph=True, **kw)
        return {type(m): (m.impl.__module__, m.impl.__qualname__)
                for m in ModelRunner(args).model.modules()
                if isinstance(m, RMSNorm | SiluAndMul | RotaryEmbedding)}

    names = lambda table: {c: (f.__module__, f.__qualname__) for c, f in table.items()}
    assert chosen("cpu") == names(CPU if cpu_ops.load() else EAGER)    # the CPU: no Triton
    assert chosen("cpu", disable_fused_ops=True) == names(EAGER)
    if DEVICE == "cpu":
        monkeypatch.setattr(dev, "use_triton", lambda device_type: True)   # pretend a GPU
    assert chosen(DEVICE) == names(FUSED)
    assert chosen(DEVICE, disable_fused_ops=True) == names(EAGER)  # --disable-fused-ops


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_kernel_model_pieces_match_eager(model_dir, dtype):
    """The C++ CPU small ops in a whole model (norms with the residual add, q/k norm over
    [T, H, D] views, rotary in place on the fused qkv output, SiLU-and-mul) against the
    eager references: bit-equal where the kernels round like them (bf16 rotary/SiLU), within
    one rounding elsewhere."""
    if not cpu_ops.load():
        pytest.skip("ferry's C++ CPU kernels do not build here")
    models = []
    for kind in ("cpu", "reference"):
        m, _ = load_model(model_dir, load_format="dummy", dtype=dtype, device="cpu", seed=3,
                          progress=False)
        assert select_ops(m, kind) == _NUM_OPS
        models.append(m)
    t = 6
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, _CONFIG["vocab_size"], (t,), generator=g)
    pos = torch.tensor([0, 1, 2, 17, 100, 127])
    attn_out = torch.randn(t, 4 * 32, generator=g).to(getattr(torch, dtype))
    outs = []
    with torch.inference_mode():
        for model in models:
            inner = model.model
            q, k, v, res = inner.piece(0, pos, input_ids=ids)
            q1, k1, v1, res1 = inner.piece(1, pos, attn_out=attn_out, residual=res)
            final = inner.piece(2, pos, attn_out=attn_out, residual=res1)
            outs.append((q, k, res, q1, k1, res1, final))
    tol = 1e-5 if dtype == "float32" else 2e-2
    for got, want in zip(*outs):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
