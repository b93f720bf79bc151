"""Block-wise FP8 linear layers (``quant_method: fp8`` with ``weight_block_size``, the
format of DeepSeek-V3/R1, Kimi-K2 and the Qwen3 ``-FP8`` checkpoints): e4m3 weights
``[N, K]`` with one fp32 scale per ``[bn, bk]`` block (``weight_scale_inv``
``[ceil(N/bn), ceil(K/bk)]``; the weight is ``Wq * scale_inv`` per block). The numerics are
:mod:`kernels.fp8.reference`'s: weight-only (W8A16) for matmuls of at most
``WEIGHT_ONLY_MAX_M`` (16) rows, as ferry's per-channel FP8 (:mod:`engine.layers.quantization.fp8`
says why), W8A8 with activations quantized per token per ``bk`` columns above.

Loading: each checkpoint part's ``weight_scale_inv`` is expanded to one row per weight row
while it loads, so the layer's own loader places it like the weight (fused q/k/v and
gate/up parts keep their own scales, tensor-parallel shards take their rows);
:meth:`Fp8BlockLinearMethod.process_weights_after_loading` then folds the rows back to one per
block of ``bn`` rows when every block of the fused weight holds one scale (every part starts
on a block boundary), and keeps one per row otherwise (``fp8_scale_row_div`` 1). A
row-parallel split must give each rank whole blocks of K, a column-parallel split whole
blocks of rows per part: others are refused when the layer is built. Float weights (dummy
weights, ``--load-format dummy`` with such a config) are quantized per block as they load.

A layer marked ``fp8_dequantize_after_load`` (DeepSeek's ``kv_b_proj``, whose weight MLA's
absorbed form reads as a float tensor) loads like the others and becomes a float layer with the
dequantized weight after loading.

Paths: the CPU keeps the dequantized fp32 weight and runs the reference
(:func:`kernels.fp8.reference.fp8_block_linear_reference`); CUDA sm89+ and XPU run the
Triton kernel :func:`kernels.fp8.block_triton.fp8_block_linear` (the e4m3 ``tl.dot`` where
``engine.device.triton_fp8_mma`` says so, else its exact fp16 upcast); older GPUs dequantize
in the run dtype and call ``torch.matmul``. No host syncs on any path.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kernels.fp8.constants import FP8_DTYPE, WEIGHT_ONLY_MAX_M
from kernels.fp8.reference import (
    dequantize_weight_blocks,
    expand_scale_rows,
    fp8_block_linear_reference,
    quantize_weight_blocks,
)

logger = logging.getLogger(__name__)


def _materialize(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.materialize()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_parts(layer: nn.Module) -> list[int]:
    """The rows of each checkpoint part that one rank holds (a column-parallel layer)."""
    tp = layer.tp_size
    if hasattr(layer, "output_sizes"):                 # MergedColumnLinear
        return [s // tp for s in layer.output_sizes]
    if hasattr(layer, "num_kv_heads"):                 # QKVLinear
        return [layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim]
    return [layer.output_size]


def check_block_split(layer: nn.Module, block: tuple[int, int]) -> None:
    """Refuse a tensor-parallel split that cuts a block.

    Raises:
        ValueError: (one line) a row-parallel rank's K or a column-parallel rank's rows of a
            part not a multiple of the block.
    """
    if layer.tp_size == 1:
        return
    bn, bk = block
    what = f"{type(layer).__name__} with block-wise FP8 ({bn}x{bk} blocks)"
    if hasattr(layer, "reduce_results"):               # RowParallelLinear: K is split
        if layer.input_size % bk:
            raise ValueError(f"--tp-size {layer.tp_size} gives each rank {layer.input_size} "
                             f"input columns of a {what}, not whole blocks of {bk}")
    elif layer.shards_output:
        bad = [r for r in _split_parts(layer) if r % bn]
        if bad:
            raise ValueError(f"--tp-size {layer.tp_size} gives each rank {bad[0]} rows of a "
                             f"part of a {what}, not whole blocks of {bn}")


class Fp8BlockLinearMethod:
    """The block-FP8 quant method a ``LinearBase`` delegates to (one per model).

    It owns ``weight`` ([out, in] float8_e4m3fn) and ``weight_scale_inv`` (fp32; [out,
    ceil(in/bk)] while loading, see the module docstring), their loaders, the post-load
    folding of the scales and choice of path, and :meth:`apply`.
    """

    def __init__(self, config):
        self.config = config
        self.block = tuple(config.weight_block_size)

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Register ``layer.weight`` [output_size, input_size] e4m3 and
        ``layer.weight_scale_inv`` [output_size, ceil(input_size / bk)] fp32.

        Raises:
            ValueError: a tensor-parallel split off the block boundaries
                (:func:`check_block_split`).
        """
        check_block_split(layer, self.block)
        n, k = layer.output_size, layer.input_size
        weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE), requires_grad=False)
        scale = nn.Parameter(torch.empty(n, _cdiv(k, self.block[1]), dtype=torch.float32),
                             requires_grad=False)
        weight.weight_loader = lambda p, t, s=None: self.load_weight(layer, p, t, s)
        scale.weight_loader = lambda p, t, s=None: self.load_scale(layer, p, t, s)
        scale.derived = not self.config.checkpoint_fp8
        layer.weight = weight
        layer.weight_scale_inv = scale
        layer.fp8_scale_row_div = 1
        layer.fp8_run_dtype = dtype
        layer.fp8_weight_upcast = None
        layer.fp8_block_kernel = None
        layer.fp8_block_upcast = False

    def load_weight(self, layer: nn.Module, param: nn.Parameter, loaded,
                    shard_id: str | int | None = None) -> None:
        """Load one HF weight: e4m3 from a block-FP8 checkpoint as is; a float tensor is
        quantized per block (whole, before the layer narrows it) and its scales go to
        ``weight_scale_inv`` through the same shard logic.

        Raises:
            ValueError: a float tensor where the checkpoint should be FP8, or the reverse.
        """
        name = type(layer).__name__
        dtype = getattr(loaded, "dtype", None)
        if self.config.checkpoint_fp8:
            if dtype not in (FP8_DTYPE, None):
                raise ValueError(f"{name}: the checkpoint's quantization_config (block-wise "
                                 f"FP8) says FP8, but a weight is {dtype}; list unquantized "
                                 "layers in its 'ignored_layers'")
            layer.weight_loader(param, loaded, shard_id)
            return
        w = _materialize(loaded)
        if w.dtype == FP8_DTYPE:
            raise ValueError(f"{name}: an FP8 weight in a checkpoint without an FP8 "
                             "quantization_config (its scales are unknown)")
        q, s = quantize_weight_blocks(w.to(param.device), self.block)
        layer.weight_loader(param, q, shard_id)
        layer.weight_loader(layer.weight_scale_inv,
                            expand_scale_rows(s, w.shape[0], self.block[0]), shard_id)

    def load_scale(self, layer: nn.Module, param: nn.Parameter, loaded,
                   shard_id: str | int | None = None) -> None:
        """Load a checkpoint ``weight_scale_inv`` ``[ceil(rows/bn), ceil(K/bk)]`` (rows of
        the part): expanded to one row per weight row and placed by the layer's loader."""
        s = _materialize(loaded).to(torch.float32)
        if s.dim() != 2:
            raise ValueError(f"{type(layer).__name__}: weight_scale_inv of shape "
                             f"{tuple(s.shape)}, expected [row blocks, column blocks]")
        rows = s.shape[0] * self.block[0]
        if shard_id is None:   # the whole layer's rows (over every rank when column-split)
            rows = min(rows, layer.output_size * (layer.tp_size if layer.shards_output else 1))
        layer.weight_loader(param, expand_scale_rows(s, rows, self.block[0]), shard_id)

    def process_weights_after_loading(self, layer: nn.Module, device_type: str,
                                      name: str = "") -> None:
        """Check the scales, fold them to one row per block of rows where they allow it, and
        pick the path for ``device_type``.

        Raises:
            ValueError: a checkpoint scale that is negative, NaN or infinite.
        """
        from engine import device as dev

        s = layer.weight_scale_inv.data
        if self.config.checkpoint_fp8 and (not bool(torch.isfinite(s).all())
                                           or bool((s < 0).any())):
            raise ValueError(f"{name or type(layer).__name__}: the checkpoint's "
                             "weight_scale_inv has negative, NaN or infinite values")
        bn, bk = self.block
        if getattr(layer, "fp8_dequantize_after_load", False):
            # a layer whose weight is also read as a float tensor (MLA's kv_b_proj): the
            # dequantized weight in the run dtype, a float layer from now on
            w = dequantize_weight_blocks(layer.weight, s, bk, 1)
            layer.drop_quantization(layer.fp8_run_dtype)
            layer.weight.data.copy_(w)
            return
        folded = s[::bn].contiguous()
        if torch.equal(expand_scale_rows(folded, s.shape[0], bn), s):
            layer.weight_scale_inv.data = folded
            layer.fp8_scale_row_div = bn
        else:
            logger.debug("%s: a part does not start on a block of %d rows; one scale row per "
                         "weight row", name, bn)
        if device_type == "cpu":
            # the dequantized fp32 weight, once (the CPU upcasts e4m3 slowly)
            layer.fp8_weight_upcast = dequantize_weight_blocks(
                layer.weight, layer.weight_scale_inv, bk, layer.fp8_scale_row_div)
        elif dev.triton_fp8_e4m3(device_type) and bk >= 16 and bk & (bk - 1) == 0:
            from kernels.fp8.block_triton import fp8_block_linear
            from kernels.split_k import split_k_locks

            layer.fp8_block_kernel = fp8_block_linear
            layer.fp8_block_upcast = not dev.triton_fp8_mma(device_type)
            split_k_locks(layer.weight.device)   # allocated now, before any graph capture

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in]`` (run dtype) -> ``[..., out]`` in x's dtype (module docstring)."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        n = layer.output_size
        quant_x = x2.shape[0] > WEIGHT_ONLY_MAX_M
        bk, div = self.block[1], layer.fp8_scale_row_div
        if x2.shape[0] == 0:
            y = x2.new_empty(0, n)
        elif layer.fp8_block_kernel is not None:
            y = layer.fp8_block_kernel(x2, layer.weight, layer.weight_scale_inv, bk, div,
                                       quant_x=quant_x, upcast=layer.fp8_block_upcast,
                                       out_dtype=x.dtype)
        else:
            compute = torch.float32 if x.device.type == "cpu" else x.dtype
            y = fp8_block_linear_reference(x2, layer.weight, layer.weight_scale_inv, bk, div,
                                           quant_x, layer.fp8_weight_upcast, compute)
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], n)
