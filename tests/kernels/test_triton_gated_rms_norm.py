"""Qwen3-Next's gated RMSNorm: the Triton kernel (kernels/fused_ops.py ``gated_rms_norm``) vs
the one eager version (kernels/reference.py ``gated_rms_norm_ref``), over head rows
``[T, Hv, V]`` (1..200 rows, V = 128 and a non-power-of-two V, strided views), and
``select_ops`` putting it on a tiny Qwen3-Next model's ``GatedRMSNorm`` modules. The
interpreter rounds bf16 unlike the GPU, so bf16 (Qwen3.5's decode shape) runs on the GPU only.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, GPU_MARKS, assert_close  # noqa: E402

from engine.layers import select_ops  # noqa: E402
from engine.layers.norm import GatedRMSNorm  # noqa: E402
from kernels import fused_ops, reference  # noqa: E402

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
EPS = 1e-6


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(dtype).to(DEVICE)


def _check(got, want, dtype):
    """Same dtype and shape; within the kernel's own ulps (rsqrt, exp) of the reference. In
    16 bits almost every value is bit-equal: the same rounding order (dropping the rounding
    of the normed value or of ``weight * normed`` changes a quarter or more of them)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, dtype, "gated_rms_norm")
    tol = {F32: (1e-5, 1e-6), F16: (2e-3, 1e-5), BF16: (1.6e-2, 1e-4)}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol[0], atol=tol[1])
    if got.dtype != F32:
        assert (got != want).float().mean().item() < 0.02, "not the reference's rounding"


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("v", [128, 96])
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 200])
def test_matches_reference(rows, v, dtype):
    x = _rand((rows, v), dtype, 1, scale=3.0)
    gate = _rand((rows, v), dtype, 2, scale=2.0)
    w = _rand((v,), dtype, 3)
    x0, g0 = x.clone(), gate.clone()
    got = fused_ops.gated_rms_norm(x, gate, w, EPS)
    _check(got, reference.gated_rms_norm_ref(x, gate, w, EPS), dtype)
    assert torch.equal(x, x0) and torch.equal(gate, g0)           # out-of-place


@pytest.mark.parametrize("dtype", [F32, F16])
def test_head_views_read_in_place(dtype):
    """x and gate as [T, Hv, V] views with their own strides (a projection's slice, heads
    padded apart), a [N, V] view with a row stride > V, and more leading axes."""
    t, hv, v = 7, 3, 80
    base_x = _rand((t, hv, v + 16), dtype, 1, scale=3.0)
    x = base_x[..., 8:8 + v]                                  # strides (hv*(v+16), v+16, 1)
    base_g = _rand((t, 2 * hv * v + 5), dtype, 2)
    gate = base_g[:, 5:5 + hv * v].view(t, hv, v)             # strides (2*hv*v+5, v, 1)
    w = _rand((v,), dtype, 3)
    got = fused_ops.gated_rms_norm(x, gate, w, EPS)
    _check(got, reference.gated_rms_norm_ref(x, gate, w, EPS), dtype)
    assert got.is_contiguous()
    rows_x, rows_g = x[:, 1], gate[:, 2]                      # [T, V], row strides > V
    _check(fused_ops.gated_rms_norm(rows_x, rows_g, w, EPS),
           reference.gated_rms_norm_ref(rows_x, rows_g, w, EPS), dtype)
    x4, g4 = x.unflatten(0, (1, t)), gate.unflatten(0, (1, t))   # [1, T, Hv, V]
    _check(fused_ops.gated_rms_norm(x4, g4, w, EPS),
           reference.gated_rms_norm_ref(x4, g4, w, EPS), dtype)


def test_mixed_dtypes_round_like_the_reference():
    """An fp32 weight on fp16 values (the product is not rounded to fp16) and an fp32 gate."""
    x = _rand((5, 4, 64), F16, 1, scale=3.0)
    gate = _rand((5, 4, 64), F32, 2)
    w = _rand((64,), F32, 3)
    got = fused_ops.gated_rms_norm(x, gate, w, EPS)
    _check(got, reference.gated_rms_norm_ref(x, gate, w, EPS), F16)


def test_refuses_bad_layouts():
    x, gate, w = _rand((4, 8), F32, 1), _rand((4, 8), F32, 2), _rand((8,), F32, 3)
    with pytest.raises(ValueError, match="unit-stride"):
        fused_ops.gated_rms_norm(x.t().contiguous().t(), gate, w, EPS)
    with pytest.raises(ValueError, match="unit-stride"):
        fused_ops.gated_rms_norm(x, gate.t().contiguous().t(), w, EPS)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_ops.gated_rms_norm(x, gate[:3], w, EPS)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_ops.gated_rms_norm(x, gate, w[:4], EPS)
    assert fused_ops.gated_rms_norm(x[:0], gate[:0], w, EPS).shape == (0, 8)


# a tiny Qwen3-Next: Gated DeltaNet in layers 0 and 2 (4 value heads of 8), MoE MLPs
_CONFIG = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
           "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_hidden_layers": 4, "max_position_embeddings": 128,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 48, "rms_norm_eps": 1e-6,
           "layer_types": ["linear_attention", "full_attention"] * 2,
           "tie_word_embeddings": False}


def test_select_ops_sets_qwen3_next_gated_norms(tmp_path):
    from engine.loader.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps(_CONFIG))
    model, _ = load_model(str(tmp_path), load_format="dummy", dtype="float32", device=DEVICE,
                          seed=3, progress=False)
    norms = [m for m in model.modules() if isinstance(m, GatedRMSNorm)]
    assert len(norms) == 2                                # one per Gated DeltaNet layer
    name = lambda f: (f.__module__, f.__qualname__)   # noqa: E731 (the conftest may reload)
    assert all(name(m.impl) == name(reference.gated_rms_norm_ref) for m in norms)
    select_ops(model, "triton")
    assert all(name(m.impl) == name(fused_ops.gated_rms_norm) for m in norms)
    norm = norms[0]
    x, z = _rand((3, 4, 8), F32, 4, scale=3.0), _rand((3, 4, 8), F32, 5)
    with torch.no_grad():
        norm.weight.copy_(_rand((8,), F32, 6))
        fused = norm(x, z)
        select_ops(model, "reference")
        assert all(name(m.impl) == name(reference.gated_rms_norm_ref) for m in norms)
        _check(fused, norm(x, z), F32)


@pytest.mark.parametrize("rows", [32, 1])
@GPU_MARKS[0]
@GPU_MARKS[1]
def test_qwen35_decode_shape_bf16(rows):
    """Qwen3.5-35B-A3B's bs1 decode: [1, 32, 128] head rows in bf16 (and one row)."""
    x = _rand((1, rows, 128), BF16, 1, scale=3.0)
    gate = _rand((1, rows, 128), BF16, 2, scale=2.0)
    w = _rand((128,), BF16, 3)
    got = fused_ops.gated_rms_norm(x, gate, w, EPS)
    want = reference.gated_rms_norm_ref(x, gate, w, EPS)
    _check(got, want, BF16)
