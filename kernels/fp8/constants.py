"""The FP8 numbers shared by the FP8 linear layers (:mod:`engine.layers.quantization.fp8`),
their Triton kernels (:mod:`kernels.fp8.fp8_triton`) and the torch references
(:mod:`kernels.fp8.reference`): the e4m3 format, the scale floor and the M thresholds of the
paths. They live in kernels/ because the kernels, which sit below the engine, need them.

See :mod:`engine.layers.quantization.fp8` for what the thresholds choose.
"""

from __future__ import annotations

import os

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
SCALE_EPS = 1e-12
#: matmuls with at most this many rows of activations are weight-only (W8A16), see fp8.py;
#: ``FERRY_FP8_WEIGHT_ONLY_MAX_M`` (0..16) changes it, 0 quantizes activations at every M
#: (the numerics and kernels of ferry before the small-M kernel, for benchmarks)
WEIGHT_ONLY_MAX_M = max(0, min(16, int(os.environ.get("FERRY_FP8_WEIGHT_ONLY_MAX_M", 16))))
#: W8A8 matmuls with at most this many rows run ferry's FP8-dot Triton kernel where Triton
#: has FP8 tensor cores (``fp8_triton.fp8_linear_fp8_dot``), larger ones ``_scaled_mm``;
#: ``FERRY_FP8_MEDIUM_M_MAX=0`` sends them all to ``_scaled_mm`` (for benchmarks)
MEDIUM_M_MAX = max(0, min(64, int(os.environ.get("FERRY_FP8_MEDIUM_M_MAX", 64))))
