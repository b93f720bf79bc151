"""Which FP8 layers get the weight-only small-M Triton kernel: wherever Triton can load e4m3
(``engine.device.triton_fp8_e4m3``: CUDA sm89+, XPU), whatever the ``_scaled_mm`` probe
said (weight-only never calls it), and not on the layers that fall back for their shape.
The CPU stands in for an XPU whose oneDNN has no ``_scaled_mm``; nothing is launched."""

from __future__ import annotations

import pytest
import torch

from engine import device as dev
from engine.layers.linear import RowParallelLinear
from engine.layers.quantization import Fp8Config, process_weights_after_loading, quantization_scope
from kernels.fp8.fp8_triton import fp8_linear_small_m


def _layer(n, k):
    with quantization_scope(Fp8Config(False, "test")):
        lin = RowParallelLinear(k, n, False, torch.bfloat16, tp_size=1, tp_rank=0)
    lin.weight.weight_loader(lin.weight, torch.randn(n, k, generator=torch.Generator()
                                                    .manual_seed(0)))
    return lin


@pytest.mark.parametrize("probe", ["dequant", "scaled_mm"])
def test_small_m_follows_triton_not_the_probe(monkeypatch, probe):
    monkeypatch.setattr(dev, "fp8_linear_backend", lambda d: probe)
    monkeypatch.setattr(dev, "triton_fp8_e4m3", lambda d: True)
    lin, odd = _layer(256, 512), _layer(72, 200)
    process_weights_after_loading(lin, "xpu")
    process_weights_after_loading(odd, "xpu")
    assert lin.fp8_backend == probe and lin.fp8_small_m is fp8_linear_small_m
    assert odd.fp8_backend == "dequant" and odd.fp8_small_m is None  # as before


def test_no_small_m_where_triton_cannot_load_e4m3(monkeypatch):
    monkeypatch.setattr(dev, "fp8_linear_backend", lambda d: "scaled_mm")
    monkeypatch.setattr(dev, "triton_fp8_e4m3", lambda d: False)  # e.g. CUDA below sm89
    lin = _layer(256, 512)
    process_weights_after_loading(lin, "cuda")
    assert lin.fp8_small_m is None
    lin = _layer(256, 512)
    process_weights_after_loading(lin, "cpu")
    assert lin.fp8_small_m is None and lin.fp8_weight_upcast is not None
