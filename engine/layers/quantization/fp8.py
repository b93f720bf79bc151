"""FP8 linear layers: e4m3 weights with per-output-channel scales; activations quantized
per token at run time (W8A8) when a matmul has more than 16 rows, weight-only (W8A16) below.

Numerics (one definition, shared by every path; ``q(v, s)`` rounds ``clamp(v / s, ±448)`` to
``float8_e4m3fn``, nearest even):

- weight ``W [N, K]`` -> ``Wq [N, K]`` e4m3 and ``sw [N]`` fp32 with
  ``sw_n = max(amax_k |W_nk|, 1e-12) / 448`` (quantized at load time, or read from an FP8
  checkpoint, whose per-tensor scales are expanded to one per row);
- activation ``x [M, K]`` with M > ``WEIGHT_ONLY_MAX_M`` rows (prefill, large decode
  batches) -> ``xq [M, K]`` e4m3 and ``sx [M, 1]`` fp32, the same formula per row (token),
  computed in every forward (dynamic; a checkpoint's static ``input_scale`` is not used);
  ``y = (xq @ Wq^T) * sx * sw^T (+ bias)``, accumulated in fp32 (W8A8);
- with M <= ``WEIGHT_ONLY_MAX_M`` (16) rows the activations are not quantized:
  ``y = (x @ Wq^T) * sw^T (+ bias)`` (W8A16). Such a matmul is a weight read; quantizing
  its activations costs a pass over x before the weights stream (a separate kernel, or a
  serial amax loop in the GEMV, which measured 1.5-2x the weight-only kernel's time on the
  H200) and buys nothing, and weight-only is the more accurate of the two (KL 0.020 vs
  0.031 on SmolLM2, docs/benchmarks.md). The rule depends on M only, so the CPU reference
  and every device compute the same function; like any change of GEMM kernel with the
  batch size, a request's logits can move when its batch crosses 16 rows.

Paths (chosen per layer in :meth:`Fp8LinearMethod.process_weights_after_loading`):

- ``small_m`` (M <= 16 where Triton loads e4m3: CUDA sm89+, XPU; independent of the
  ``_scaled_mm`` probe, which weight-only never calls): ferry's Triton kernel
  ``kernels.fp8.fp8_triton.fp8_linear_small_m``, which streams the e4m3 weights once (split over K
  into enough programs to keep every SM loading) and upcasts them in registers. cuBLASLt's
  FP8 GEMM behind ``_scaled_mm`` is tuned for large M and read the 8B's weights at 1.0-2.5
  TB/s there (``bench.kernels.sweep_gemm --fp8``). Without Triton, the dequant path below does the
  weight-only product.
- ``fp8_dot`` (16 < M <= ``MEDIUM_M_MAX`` (64), CUDA sm89+): the same kernel in its W8A8
  mode, ``kernels.fp8.fp8_triton.fp8_linear_fp8_dot``: the Triton quantizer, then e4m3 x e4m3
  ``tl.dot`` on the FP8 tensor cores with fp32 accumulation (``_scaled_mm``'s numerics up
  to the order of the sums). Per Llama-3-8B layer at M = 64 on the H200: 84 us against
  119 us for quant + ``_scaled_mm`` and 125 us for bf16 (``bench.kernels.sweep_gemm --fp8-medium``).
- ``scaled_mm`` (``engine.device.fp8_linear_backend``: CUDA sm89+, XPU with torch >= 2.10):
  ``torch._scaled_mm(xq, Wq.t(), scale_a=sx [M,1], scale_b=sw [1,N], out_dtype=bf16)``. It
  needs K and N multiples of 16, ``xq`` row-major and ``Wq.t()`` column-major (``Wq`` is
  stored row-major [N, K], so the transpose is a view). Its row-wise kernels write bf16 only,
  so a fp16/fp32 run casts the result. A layer whose K or N is not a multiple of 16 takes the
  dequant path. The activation quantization is one Triton program per token
  (:mod:`kernels.fp8.fp8_triton`) on GPUs, the torch reference (:mod:`kernels.fp8.reference`)
  on the CPU.
- ``dequant``: the e4m3 operands are upcast (exactly) and multiplied in fp32 on the CPU (the
  reference) or bf16 on accelerators without FP8 matmuls, then scaled.

Every path is free of host syncs (graph capturable). The weights stay e4m3 in memory on
every path (1 byte per weight, plus 4 bytes per output row).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.layers.quantization.fp8_block import Fp8BlockLinearMethod
from kernels.fp8.constants import FP8_DTYPE, MEDIUM_M_MAX, WEIGHT_ONLY_MAX_M
from kernels.fp8.reference import fp8_matmul_dequant, fp8_matmul_weight_only, quantize_rows

logger = logging.getLogger(__name__)


def _device_quantizer(device_type: str):
    """The activation quantizer for ``device_type``: the Triton kernel on GPUs (the torch
    reference, with a warning, where triton does not import), the reference on the CPU."""
    from engine import device as dev

    if not dev.use_triton(device_type):
        return quantize_rows
    try:
        from kernels.fp8.fp8_triton import quantize_rows_triton
    except ImportError as e:
        logger.warning("FP8 activations quantized with torch ops (triton: %s)", e)
        return quantize_rows
    return quantize_rows_triton


def _small_m_kernel(device_type: str):
    """The small-M Triton kernel (``fp8_linear_small_m``) for ``device_type``, or None where
    Triton cannot load e4m3 (``engine.device.triton_fp8_e4m3``) or no matmul is weight-only.
    Weight-only, it never calls ``_scaled_mm``, so it does not depend on that probe."""
    from engine import device as dev

    if WEIGHT_ONLY_MAX_M == 0 or not dev.triton_fp8_e4m3(device_type):
        return None
    try:
        from kernels.fp8.fp8_triton import fp8_linear_small_m
    except ImportError:
        return None
    return fp8_linear_small_m


def _medium_m_kernel(device_type: str):
    """The FP8-dot Triton kernel (``fp8_linear_fp8_dot``) for W8A8 matmuls of 17-64 rows, or
    None where Triton has no FP8 tensor cores (``engine.device.triton_fp8_mma``)."""
    from engine import device as dev

    if MEDIUM_M_MAX <= WEIGHT_ONLY_MAX_M or not dev.triton_fp8_mma(device_type):
        return None
    try:
        from kernels.fp8.fp8_triton import fp8_linear_fp8_dot
    except ImportError:
        return None
    return fp8_linear_fp8_dot


def _materialize(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.materialize()


def _dtype_of(t) -> torch.dtype | None:
    return getattr(t, "dtype", None)


@dataclass
class Fp8Config:
    """How a model's linear layers are quantized.

    Attributes:
        checkpoint_fp8: the checkpoint holds e4m3 weights and ``weight_scale`` tensors; False:
            float weights quantized while they load (``--quantization fp8``, dummy weights).
        source: where the scheme came from: ``"fp8"`` / ``"compressed-tensors"`` (the
            checkpoint's ``quantization_config.quant_method``) or ``"--quantization fp8"``.
        activation_scheme: the checkpoint's (``dynamic``, ``static`` or ``none`` for
            weight-only); informational: activations are always quantized per token at run
            time.
        ignore: HF module names (or ``re:`` regexes) kept in the run dtype.
        weight_block_size: ``(bn, bk)`` for block-wise FP8 (one weight scale per block,
            :mod:`engine.layers.quantization.fp8_block`), None for per-channel scales.
    """

    checkpoint_fp8: bool
    source: str
    activation_scheme: str = "dynamic"
    ignore: list[str] = field(default_factory=list)
    weight_block_size: tuple[int, int] | None = None

    def is_ignored(self, hf_module: str) -> bool:
        """Whether HF module ``hf_module`` (e.g. ``model.layers.0.mlp.down_proj``) stays
        unquantized: an exact entry of ``ignore``, or a ``re:PATTERN`` that matches it."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], hf_module):
                    return True
            elif entry == hf_module:
                return True
        return False

    def linear_method(self) -> Fp8LinearMethod | Fp8BlockLinearMethod:
        if self.weight_block_size is not None:
            return Fp8BlockLinearMethod(self)
        return Fp8LinearMethod(self)


class Fp8LinearMethod:
    """The FP8 quant method a ``LinearBase`` delegates to (one instance per model).

    It owns the layer's ``weight`` ([out, in] float8_e4m3fn) and ``weight_scale`` ([out]
    fp32) parameters, their weight loaders (which then call the layer's own, so fused
    q/k/v and gate/up parts and tensor-parallel shards land where the unquantized weights
    would), the post-load choice of the matmul path, and :meth:`apply`.
    """

    def __init__(self, config: Fp8Config):
        self.config = config

    # ---- weights ---------------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Register ``layer.weight`` [output_size, input_size] e4m3 and ``layer.weight_scale``
        [output_size] fp32 (uninitialised, on the current default device).

        ``dtype`` is the run dtype (activations, bias and output). ``weight_scale.derived``
        marks it as computed from the weight (online quantization), so a checkpoint need
        not hold it.
        """
        n, k = layer.output_size, layer.input_size
        weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE), requires_grad=False)
        scale = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        weight.weight_loader = lambda p, t, s=None: self.load_weight(layer, p, t, s)
        scale.weight_loader = lambda p, t, s=None: self.load_scale(layer, p, t, s)
        scale.derived = not self.config.checkpoint_fp8
        layer.weight = weight
        layer.weight_scale = scale
        layer.fp8_backend = "dequant"
        layer.fp8_quantize = quantize_rows
        layer.fp8_weight_upcast = None
        layer.fp8_small_m = None
        layer.fp8_medium_m = None

    def load_weight(self, layer: nn.Module, param: nn.Parameter, loaded,
                    shard_id: str | int | None = None) -> None:
        """Load one (full, unsplit) HF weight: an e4m3 tensor from an FP8 checkpoint is
        copied as is; a float tensor is quantized per row first, and its scales go to
        ``weight_scale`` through the same shard logic.

        Quantizing the full tensor before the layer narrows it keeps every row's scale
        independent of the tensor-parallel split.

        Raises:
            ValueError: a float tensor where the checkpoint should be FP8, or the reverse.
        """
        name = type(layer).__name__
        if self.config.checkpoint_fp8:
            if _dtype_of(loaded) not in (FP8_DTYPE, None):
                raise ValueError(f"{name}: the checkpoint's quantization_config "
                                 f"({self.config.source}) says FP8, but a weight is "
                                 f"{_dtype_of(loaded)}; list unquantized layers in its "
                                 "'ignore' list")
            layer.weight_loader(param, loaded, shard_id)
            return
        w = _materialize(loaded)
        if w.dtype == FP8_DTYPE:
            raise ValueError(f"{name}: an FP8 weight in a checkpoint without an FP8 "
                             "quantization_config (its scales are unknown)")
        q, s = quantize_rows(w.to(param.device))
        layer.weight_loader(param, q, shard_id)
        layer.weight_loader(layer.weight_scale, s.view(-1), shard_id)

    def load_scale(self, layer: nn.Module, param: nn.Parameter, loaded,
                   shard_id: str | int | None = None) -> None:
        """Load a checkpoint ``weight_scale``: per-tensor (``[]`` or ``[1]``) is expanded to
        every row of its part; per-channel (``[out, 1]`` or ``[out]``) is narrowed like the
        weight's rows."""
        s = _materialize(loaded).to(torch.float32).reshape(-1)
        if s.numel() == 1:
            # long enough for any shard offset the layer's loader takes (rank * size + size)
            n = param.shape[0] * (layer.tp_size if layer.shards_output else 1)
            s = s.expand(n)
        layer.weight_loader(param, s, shard_id)

    def process_weights_after_loading(self, layer: nn.Module, device_type: str,
                                      name: str = "") -> None:
        """Check the scales and pick the layer's matmul path and activation quantizer.

        Raises:
            ValueError: a checkpoint scale that is negative, NaN or infinite.
        """
        from engine import device as dev

        if self.config.checkpoint_fp8:
            s = layer.weight_scale
            if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
                raise ValueError(f"{name or type(layer).__name__}: the checkpoint's "
                                 "weight_scale has negative, NaN or infinite values")
        backend = dev.fp8_linear_backend(device_type)
        odd = bool(layer.input_size % 16 or layer.output_size % 16)
        if backend == "scaled_mm" and odd:
            logger.debug("%s: [%d, %d] is not a multiple of 16; dequant path", name,
                         layer.output_size, layer.input_size)
            backend = "dequant"
        layer.fp8_backend = backend
        layer.fp8_quantize = _device_quantizer(device_type)
        # weight-only small M: wherever Triton loads e4m3, whatever the _scaled_mm probe said
        # (an XPU whose oneDNN lacks it would otherwise upcast every weight in every step)
        layer.fp8_small_m = None if odd else _small_m_kernel(device_type)
        layer.fp8_medium_m = _medium_m_kernel(device_type) if backend == "scaled_mm" else None
        if layer.fp8_small_m is not None or layer.fp8_medium_m is not None:
            from kernels.fp8.fp8_triton import split_k_locks
            split_k_locks(layer.weight.device)   # allocated now, before any graph capture
        # the CPU upcasts e4m3 element by element (~20 ns each): keep the exact fp32 values
        # of the weights instead of upcasting them in every step (CPU memory is not saved)
        layer.fp8_weight_upcast = layer.weight.float() if device_type == "cpu" else None

    # ---- forward ---------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in]`` (run dtype) -> ``[..., out]`` in x's dtype, see the module
        docstring. No host syncs."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        n = layer.output_size
        if x2.shape[0] == 0:
            y = x2.new_empty(0, n)
        elif x2.shape[0] <= WEIGHT_ONLY_MAX_M:
            if layer.fp8_small_m is not None:
                y = layer.fp8_small_m(x2, layer.weight, layer.weight_scale, quant_x=False)
            else:
                compute = torch.float32 if x.device.type == "cpu" else x.dtype
                w = (layer.fp8_weight_upcast if layer.fp8_weight_upcast is not None
                     else layer.weight)
                y = fp8_matmul_weight_only(x2, w, layer.weight_scale, compute)
        elif layer.fp8_medium_m is not None and x2.shape[0] <= MEDIUM_M_MAX \
                and x2.dtype in (torch.bfloat16, torch.float16):
            y = layer.fp8_medium_m(x2, layer.weight, layer.weight_scale)
        elif layer.fp8_backend == "scaled_mm":
            xq, sx = layer.fp8_quantize(x2)
            y = torch._scaled_mm(xq, layer.weight.t(), scale_a=sx,
                                 scale_b=layer.weight_scale.unsqueeze(0),
                                 out_dtype=torch.bfloat16)
        else:
            xq, sx = layer.fp8_quantize(x2)
            compute = torch.float32 if x.device.type == "cpu" else torch.bfloat16
            w = layer.fp8_weight_upcast if layer.fp8_weight_upcast is not None else layer.weight
            y = fp8_matmul_dequant(xq, sx, w, layer.weight_scale, compute)
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], n)
