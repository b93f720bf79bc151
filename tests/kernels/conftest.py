"""Kernel tests: run the Triton kernels in the interpreter on the CPU, natively on a GPU.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is *defined*, so it is set here,
before any test module imports ``kernels.*``. On a CUDA/XPU machine the variable is left
alone and the very same tests run compiled on the device (``DEVICE`` below). Tests that only
make sense on an accelerator (bf16 ``tl.dot``, graph capture, bigger sizes) carry the
``gpu`` marker and are skipped on the CPU.
"""

from __future__ import annotations

import importlib
import os
import sys

from engine.device import resolve_device

DEVICE = resolve_device("auto")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    # A kernel module imported before this conftest (by another test directory) was
    # compiled for a GPU that is not here; re-define its kernels for the interpreter.
    for _name in ("kernels.kv_store", "kernels.decode_attention", "kernels.extend_attention",
                  "kernels.fused_ops", "kernels.rotary", "kernels.lora.lora_triton",
                  "kernels.fp8.fp8_triton", "kernels.mla.decode", "kernels.mla.prefill",
                  "kernels.linear_attention.decode_triton",
                  "kernels.linear_attention.decode_prologue"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])
