"""Weight-only low-bit linear layers: the part shared by GGUF blocks, AWQ and GPTQ.

A layer holds its weight in one of :mod:`kernels.quant.reference`'s layouts (``q4``: uint8
``weight [N, K/2]`` plus ``weight_scale`` and ``weight_min [N, K/G]``; ``q8``: int8
``weight [N, K]`` plus ``weight_scale``); activations stay in the run dtype (W4A16 / W8A16
on GPUs, W4A32 / W8A32 on the CPU in fp32). The scheme-specific subclasses say how a
checkpoint tensor becomes that layout (:mod:`engine.layers.quantization.gguf`).

Paths (chosen per layer in :meth:`WeightOnlyMethod.process_weights_after_loading`):

- ``cpu``: ferry's C++ kernels (``kernels/cpu/wq.cpp``): with at most ``CPU_KERNEL_MAX_M``
  rows (decode, a speculative verify) a kernel that reads the packed weights directly (fp32
  math, AVX2+FMA+F16C where the build has them, threads over output rows; from 4 rows each
  32-weight chunk is unpacked once for up to 16 rows); with more rows (prefill) the weight
  is dequantized by the C++ kernel into the run dtype in every call and multiplied by
  torch's GEMM (dequantizing SmolLM2's largest weight, 1536 x 576, takes ~0.1 ms against
  ~3 ms for a 128-row GEMM with it).
- ``triton`` (CUDA, XPU): :func:`kernels.quant.wq_triton.wq_linear`: up to 4 rows (q4) a
  GEMV without ``tl.dot`` (:mod:`kernels.quant.wq_gemv`), up to 256 rows a GEMM that unpacks
  the tiles in registers (``tl.dot`` in the activations' dtype, fp32 accumulation; K split
  over more programs at decode sizes), above that a dequantizing kernel and the vendor GEMM.
  By default q4 layers are re-laid at load into the K-major ``q4k`` layout and run
  :func:`kernels.quant.w4_tc.w4k_linear` at every M instead (a GEMV up to 4 rows, a
  tensor-core GEMM that dequantizes in registers above; issue 49); ``$FERRY_WQ_LAYOUT=rows``
  keeps the row layout and the kernels above.
- ``torch``: the reference (dequantize, then matmul), where neither kernel is available.

No host syncs on any path.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kernels.quant.reference import dequant

logger = logging.getLogger(__name__)

#: the most rows the CPU's packed-weight kernel takes; more rows dequantize and use the GEMM
CPU_KERNEL_MAX_M = 16


def small_m_max_rows(device_type: str) -> int | None:
    """The most rows (tokens) a linear call on ``device_type`` may have and still take the
    small-M path: on the CPU ``CPU_KERNEL_MAX_M`` (past it the 4-bit layers dequantize their
    weights in every call, and every row costs nearly a decode step's compute); None on an
    accelerator, where rows stay cheap."""
    return CPU_KERNEL_MAX_M if device_type == "cpu" else None


def _cpu_kernels() -> bool:
    from kernels import cpu_ops

    return cpu_ops.load() and hasattr(torch.ops.ferry_cpu, "wq_linear")


class WeightOnlyMethod:
    """A ``LinearBase``'s quant method for q4/q8 weights (one instance per model)."""

    #: the checkpoint tensor kind the weight loader expects (for error messages)
    source = "weight-only"

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Register q4 parameters with 32-weight groups and fp16 scales; the loader may
        change the layout with :meth:`set_format` before the weights load."""
        layer.wq_dtype = dtype
        self.set_format(layer, "q4", 32, torch.float16)

    def set_format(self, layer: nn.Module, fmt: str, group_size: int,
                   scale_dtype: torch.dtype) -> None:
        """(Re)register ``weight``, ``weight_scale`` (and, for q4, ``weight_min``), empty."""
        n, k = layer.output_size, layer.input_size
        if k % group_size or group_size % 32:
            raise ValueError(f"{type(layer).__name__}: input size {k} is not a multiple of "
                             f"the quantization group ({group_size}, a multiple of 32)")
        device = layer.weight.device if "weight" in layer._parameters else None
        for name in ("weight", "weight_scale", "weight_min"):
            layer._parameters.pop(name, None)
        shape, wdtype = ((n, k // 2), torch.uint8) if fmt == "q4" else ((n, k), torch.int8)
        weight = nn.Parameter(torch.empty(shape, dtype=wdtype, device=device),
                              requires_grad=False)
        weight.weight_loader = lambda p, t, s=None: self.load_weight(layer, p, t, s)
        layer.weight = weight
        names = ("weight_scale", "weight_min") if fmt == "q4" else ("weight_scale",)
        for name in names:
            p = nn.Parameter(torch.empty(n, k // group_size, dtype=scale_dtype, device=device),
                             requires_grad=False)
            p.derived = True  # filled by the weight's loader
            setattr(layer, name, p)
        layer.wq_format = fmt
        layer.wq_group_size = group_size
        layer.wq_path = "torch"

    def load_weight(self, layer: nn.Module, param: nn.Parameter, loaded,
                    shard_id: str | int | None = None) -> None:
        """Turn one checkpoint tensor into the layer's layout (:meth:`pack`) and load each
        packed tensor through the layer's own loader (fused parts, tensor-parallel shards:
        every packed tensor is ``[rows, ...]`` along the weight's rows, and along K in
        proportion, so the float layers' narrowing applies unchanged)."""
        packed = self.pack(layer, loaded)
        for name, t in packed.items():
            layer.weight_loader(getattr(layer, name), t, shard_id)

    def pack(self, layer: nn.Module, loaded) -> dict[str, torch.Tensor]:  # pragma: no cover
        """``{parameter name: full packed tensor}`` for one checkpoint tensor."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module, device_type: str,
                                      name: str = "") -> None:
        """Pick the layer's matmul path (module docstring)."""
        from engine import device as dev

        if device_type == "cpu":
            layer.wq_path = "cpu" if _cpu_kernels() else "torch"
        elif dev.use_triton(device_type):
            try:
                from kernels.quant.wq_triton import split_k_locks

                split_k_locks(layer.weight.device)  # allocated now, before any graph capture
                layer.wq_path = "triton"
                self._to_kmajor(layer)
            except ImportError as e:
                logger.warning("%s: low-bit weights through the torch reference (triton: %s)",
                               name, e)
                layer.wq_path = "torch"
        else:
            layer.wq_path = "torch"

    @staticmethod
    def _to_kmajor(layer: nn.Module) -> None:
        """Unless ``$FERRY_WQ_LAYOUT=rows``: re-lay a q4 layer's weight into
        :mod:`kernels.quant.w4_tc`'s ``q4k`` (``weight`` int32 ``[K/8, N]``, ``weight_scale``
        and ``weight_min`` ``[K/G, N]``), the layout of its tensor-core GEMM."""
        from kernels.quant.w4_tc import KMAJOR, kmajor_enabled, to_kmajor

        if layer.wq_format != "q4" or not kmajor_enabled():
            return
        qk, s, m = to_kmajor(layer.weight.data, layer.weight_scale.data, layer.weight_min.data)
        layer.weight = nn.Parameter(qk, requires_grad=False)
        layer.weight_scale = nn.Parameter(s, requires_grad=False)
        layer.weight_min = nn.Parameter(m, requires_grad=False)
        layer.wq_format = KMAJOR

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in x's dtype."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        perm = getattr(layer, "wq_perm", None)  # act-order: K stored sorted by group
        if perm is not None:
            x2 = x2.index_select(1, perm)
        n = layer.output_size
        mins = getattr(layer, "weight_min", None)
        args = (layer.weight, layer.weight_scale, mins)
        if x2.shape[0] == 0:
            y = x2.new_empty(0, n)
        elif layer.wq_path == "cpu":
            if x2.shape[0] <= CPU_KERNEL_MAX_M:
                y = torch.ops.ferry_cpu.wq_linear(x2.contiguous(), *args)
            else:
                w = torch.ops.ferry_cpu.wq_dequant(*args, x2.dtype)
                y = torch.nn.functional.linear(x2, w)
        elif layer.wq_path == "triton" and layer.wq_format == "q4k":
            from kernels.quant.w4_tc import w4k_linear

            y = w4k_linear(x2, *args)
        elif layer.wq_path == "triton":
            from kernels.quant.wq_triton import wq_linear

            y = wq_linear(x2, layer.wq_format, *args)
        else:
            compute = torch.float32 if x.device.type == "cpu" else x.dtype
            w = dequant(layer.wq_format, *args, dtype=compute)
            y = torch.matmul(x2.to(compute), w.t())
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], n)
