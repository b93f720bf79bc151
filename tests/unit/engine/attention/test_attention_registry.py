"""The attention-backend registry, the device default and ``--attention-backend``."""

from __future__ import annotations

import argparse
import inspect

import pytest

from engine import device as dev
from engine.args import ServerArgs
from engine.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    TorchNativeAttnBackend,
    TritonAttnBackend,
    create_attention_backend,
    resolve_attention_backend,
)


def test_registry_names_and_classes():
    assert ATTENTION_BACKENDS == {"torch_native": TorchNativeAttnBackend,
                                  "triton": TritonAttnBackend}
    for cls in ATTENTION_BACKENDS.values():
        assert issubclass(cls, AttentionBackend) and not inspect.isabstract(cls)
    assert TritonAttnBackend.supports_graphs and not TorchNativeAttnBackend.supports_graphs


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; choose one of "
                                         "torch_native, triton"):
        resolve_attention_backend("flash", "cuda")
    with pytest.raises(ValueError, match="torch_native, triton"):
        create_attention_backend("flash", 4, 2, 16)


def test_default_per_device():
    assert dev.default_attention_backend("cuda") == "triton"
    assert dev.default_attention_backend("xpu") == "triton"
    assert dev.default_attention_backend("cpu") == "torch_native"
    assert resolve_attention_backend(None, "cuda") == "triton"
    assert resolve_attention_backend(None, "xpu") == "triton"
    assert resolve_attention_backend(None, "cpu") == "torch_native"
    b = create_attention_backend(None, 8, 2, 16, device_type="cpu")
    assert type(b) is TorchNativeAttnBackend
    assert (b.num_heads, b.num_kv_heads, b.head_dim) == (8, 2, 16)
    # an explicit torch_native is fine on an accelerator too (it is device-agnostic)
    assert resolve_attention_backend("torch_native", "cuda") == "torch_native"


def test_triton_on_the_cpu_only_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA or XPU device"):
        resolve_attention_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", "cpu") == "triton"
    assert resolve_attention_backend("triton", "cuda") == "triton"


def test_heads_must_group():
    with pytest.raises(ValueError, match="not a multiple"):
        create_attention_backend("torch_native", 6, 4, 16)


def test_flag():
    p = ServerArgs.add_cli_args(argparse.ArgumentParser())
    assert ServerArgs.from_cli_args(p.parse_args([])).attention_backend is None
    a = ServerArgs.from_cli_args(p.parse_args(["--attention-backend", "torch_native"]))
    assert a.attention_backend == "torch_native"
    # the flag takes any name (a new backend needs no change in args.py); the registry
    # refuses an unknown one before anything starts (ferry serve: tests/unit/engine/test_args.py)
    flash = ServerArgs.from_cli_args(p.parse_args(["--attention-backend", "flash"]))
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*torch_native"):
        resolve_attention_backend(flash.attention_backend, "cpu")


def test_model_runner_uses_the_flag(monkeypatch):
    from engine.executor.model_runner import ModelRunner
    from engine.loader.loader import config_dir

    args = ServerArgs(model_path=config_dir("llama-tiny"), load_format="dummy", device="cpu",
                      max_total_tokens=256, max_running_requests=2)
    runner = ModelRunner(args)
    assert type(runner.attn_backend) is TorchNativeAttnBackend
    assert runner.attention_backend_name == "torch_native"
    # llama-tiny.json: 2 layers, 4 heads, 2 KV heads, hidden 64 -> head_dim 16
    mc = runner.model_config
    assert (mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (2, 4, 2, 16)
    assert (runner.num_kv_heads, runner.head_dim, runner.vocab_size) == (2, 16, 49152)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA or XPU device"):
        ModelRunner(args.replace(attention_backend="triton"))
