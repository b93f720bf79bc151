"""The device layer (``engine/device/``) is the only package that names a backend."""

import pathlib
import re

import pytest
import torch

from engine import device as dev

ROOT = pathlib.Path(__file__).resolve().parents[4]
PATTERN = re.compile(r"torch\.(cuda|xpu)\b")


def test_no_backend_calls_outside_device_py():
    device_pkg = ROOT / "engine" / "device"
    assert (device_pkg / "__init__.py").exists() and not (ROOT / "engine" / "device.py").exists()
    offenders = []
    for sub in ("engine", "kernels", "server", "bench", "tests"):
        for path in (ROOT / sub).rglob("*.py"):
            if path.is_relative_to(device_pkg) or path == pathlib.Path(__file__):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if PATTERN.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == [], "torch.cuda/torch.xpu outside engine/device/:\n" + "\n".join(offenders)


def test_resolve_device_and_dtype_on_cpu():
    d = dev.resolve_device("auto")
    assert d in ("cuda", "xpu", "cpu")
    assert dev.resolve_device("cpu") == "cpu"
    assert dev.resolve_dtype("auto", "cpu") is torch.float32
    assert dev.resolve_dtype("auto", "cuda") is torch.bfloat16
    assert dev.resolve_dtype("float16", "cpu") is torch.float16
    with pytest.raises(ValueError, match="unknown device"):
        dev.resolve_device("tpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        dev.resolve_dtype("int8", "cpu")
    assert dev.dist_backend("cuda") == "nccl"
    assert dev.dist_backend("xpu") == "xccl"
    assert dev.dist_backend("cpu") == "gloo"
    assert dev.graph_class("cpu") is None
    assert dev.use_triton("cpu") is False and dev.use_triton("xpu") is True


def test_cpu_memory_figures_are_sane():
    m = dev.memory_info("cpu")
    assert 0 < m.free <= m.total
