"""Block-wise FP8 expert weights of a :class:`engine.layers.moe.FusedMoE` (Qwen3-MoE-FP8,
the format of DeepSeek-V3's experts): the checkpoint's per-expert e4m3 ``gate_proj`` /
``up_proj`` / ``down_proj`` weights and their ``weight_scale_inv`` (one fp32 scale per
``[bn, bk]`` block) stacked like the float experts:

    w13_weight [E, 2 I_local, H] e4m3      w13_weight_scale_inv [E, R13, ceil(H / bk)] fp32
    w2_weight  [E, H, I_local]   e4m3      w2_weight_scale_inv  [E, R2, ceil(I_local / bk)]

While loading, each scale row belongs to one weight row (``R`` = the weight's rows), so the
gate and up parts and the tensor-parallel slices land like the weights; after loading the rows
fold to one per block of ``bn`` rows where every block holds one scale (the up part starts on
a block: ``I_local % bn == 0``), else they stay per row (``row_div`` 1). Tensor parallelism
must give each rank whole blocks of I (refused otherwise, when the layer is built). Float
expert tensors (dummy weights) are quantized per block as they load.

Numerics: weight-only at every M (the experts on the dequantized weights,
``kernels.moe.reference.dequantize_fp8_block_experts``). Paths: the CPU keeps the dequantized
experts in the run dtype and runs ``kernels.moe.reference.fused_moe_torch``; GPUs where Triton
loads e4m3 run ``kernels.moe.fused_moe_fp8.fused_moe_fp8_block`` (unless the layer's impl is
the torch reference, ``--disable-fused-ops``: then the experts are dequantized per call).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8.constants import FP8_DTYPE
from kernels.fp8.reference import expand_scale_rows, quantize_weight_blocks
from kernels.moe.reference import dequantize_fp8_block_experts, fused_moe_torch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Fp8BlockExperts:
    """The block-FP8 state of one ``FusedMoE`` (see the module docstring); the layer holds it
    as ``fp8_experts`` and its parameters as its own.

    Args:
        moe: the ``FusedMoE`` (its TP/EP split is set).
        block: ``(bn, bk)``.
        checkpoint: the checkpoint holds e4m3 weights and scales (False: float weights,
            quantized as they load; the scales are then ``derived``).
        dtype: the run dtype (the CPU's dequantized experts).
    Raises:
        ValueError: a per-rank intermediate size that is not whole blocks (one line).
    """

    def __init__(self, moe: nn.Module, block: tuple[int, int], checkpoint: bool,
                 dtype: torch.dtype):
        bn, bk = block
        e, h = moe.num_local_experts, moe.hidden_size
        i = moe.intermediate_size // moe.i_split
        if moe.i_split > 1 and (i % bn or i % bk):
            raise ValueError(f"--tp-size {moe.tp_size} gives each rank {i} of the experts' "
                             f"intermediate size, not whole {bn}x{bk} blocks of the block-wise "
                             "FP8 experts; use --ep-size or a smaller --tp-size")
        self.block, self.checkpoint, self.dtype = (bn, bk), checkpoint, dtype
        moe.w13_weight = _param(torch.empty(e, 2 * i, h, dtype=FP8_DTYPE))
        moe.w2_weight = _param(torch.empty(e, h, i, dtype=FP8_DTYPE))
        moe.w13_weight_scale_inv = _param(torch.empty(e, 2 * i, _cdiv(h, bk)))
        moe.w2_weight_scale_inv = _param(torch.empty(e, h, _cdiv(i, bk)))
        for name in ("w13_weight", "w2_weight"):
            getattr(moe, name).weight_loader = (
                lambda p, t, ex, sh, moe=moe: self.load_weight(moe, p, t, ex, sh))
            scale = getattr(moe, f"{name}_scale_inv")
            scale.weight_loader = lambda p, t, ex, sh, moe=moe: self.load_scale(moe, p, t, ex, sh)
            scale.derived = not checkpoint
        self.row_div = {"w13": 1, "w2": 1}
        self.dequant: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kernel = None

    def load_weight(self, moe: nn.Module, param: nn.Parameter, loaded, expert_id: int,
                    shard_id: str) -> None:
        """One HF expert weight: e4m3 as is (through ``moe.weight_loader``); a float one is
        quantized per block first and its scales loaded too.

        Raises:
            ValueError: a float weight in an FP8 checkpoint, or an e4m3 one without scales.
        """
        dtype = getattr(loaded, "dtype", None)
        if self.checkpoint:
            if dtype not in (FP8_DTYPE, None):
                raise ValueError(f"expert {shard_id} weight is {dtype} in a block-wise FP8 "
                                 "checkpoint")
            moe.weight_loader(param, loaded, expert_id, shard_id)
            return
        w = loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()
        if w.dtype == FP8_DTYPE:
            raise ValueError("an FP8 expert weight in a checkpoint without an FP8 "
                             "quantization_config (its scales are unknown)")
        q, s = quantize_weight_blocks(w.to(param.device), self.block)
        moe.weight_loader(param, q, expert_id, shard_id)
        scale = moe.w2_weight_scale_inv if shard_id == "down" else moe.w13_weight_scale_inv
        self.load_scale(moe, scale, s, expert_id, shard_id)

    def load_scale(self, moe: nn.Module, param: nn.Parameter, loaded, expert_id: int,
                   shard_id: str) -> None:
        """One expert part's ``weight_scale_inv [ceil(rows/bn), ceil(K/bk)]``: expanded to
        one row per weight row and placed like :meth:`FusedMoE.weight_loader` places the
        weight (gate/up rows of this rank's I; down: this rank's blocks of I).

        Raises:
            ValueError: a bad shard id or a scale of the wrong shape.
        """
        bn, bk = self.block
        local = expert_id - moe.first_expert
        if not 0 <= local < moe.num_local_experts:
            return
        s = (loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()).float()
        full_i, h = moe.intermediate_size, moe.hidden_size
        n = full_i // moe.i_split
        split = moe.i_split > 1
        if shard_id in ("gate", "up"):
            rows = expand_scale_rows(s, full_i, bn)
            src = rows.narrow(0, moe.tp_rank * n, n) if split else rows
            dst = param.data[local].narrow(0, 0 if shard_id == "gate" else n, n)
        elif shard_id == "down":
            rows = expand_scale_rows(s, h, bn)
            nb = n // bk if split else rows.shape[1]
            src = rows.narrow(1, moe.tp_rank * nb, nb) if split else rows
            dst = param.data[local]
        else:
            raise ValueError(f"expert shard id must be 'gate', 'up' or 'down', got {shard_id!r}")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"expert {shard_id} weight_scale_inv of shape {tuple(s.shape)} "
                             f"does not fit {tuple(dst.shape)} scale rows")
        dst.copy_(src)

    def process_weights_after_loading(self, moe: nn.Module, device_type: str,
                                      name: str = "") -> None:
        """Check and fold the scales, pick the path for ``device_type``.

        Raises:
            ValueError: a checkpoint scale that is negative, NaN or infinite.
        """
        from engine import device as dev

        bn, bk = self.block
        for part in ("w13", "w2"):
            p = getattr(moe, f"{part}_weight_scale_inv")
            s = p.data
            if self.checkpoint and (not bool(torch.isfinite(s).all()) or bool((s < 0).any())):
                raise ValueError(f"{name}: the checkpoint's expert weight_scale_inv has "
                                 "negative, NaN or infinite values")
            folded = s[:, ::bn].contiguous()
            if torch.equal(folded.repeat_interleave(bn, 1)[:, : s.shape[1]], s):
                p.data = folded
                self.row_div[part] = bn
        if device_type == "cpu":
            self.dequant = self._dequantized(moe, self.dtype)
        elif dev.triton_fp8_e4m3(device_type) and bk >= 16 and bk & (bk - 1) == 0:
            from kernels.moe.fused_moe_fp8 import fused_moe_fp8_block

            self.kernel = fused_moe_fp8_block

    def _dequantized(self, moe: nn.Module, dtype: torch.dtype):
        bk = self.block[1]
        return (dequantize_fp8_block_experts(moe.w13_weight, moe.w13_weight_scale_inv, bk,
                                             self.row_div["w13"], dtype),
                dequantize_fp8_block_experts(moe.w2_weight, moe.w2_weight_scale_inv, bk,
                                             self.row_div["w2"], dtype))

    def run(self, moe: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, device_name: str | None = None) -> torch.Tensor:
        """x [T, H] with its local expert ids -> [T, H] in x's dtype (this rank's part)."""
        if self.kernel is not None and moe.impl is not fused_moe_torch:
            return self.kernel(x, moe.w13_weight, moe.w2_weight, topk_weights, topk_ids,
                               w13_scale=moe.w13_weight_scale_inv,
                               w2_scale=moe.w2_weight_scale_inv, block_k=self.block[1],
                               w13_row_div=self.row_div["w13"], w2_row_div=self.row_div["w2"],
                               device_name=device_name)
        w13, w2 = self.dequant if self.dequant is not None else self._dequantized(moe, x.dtype)
        return fused_moe_torch(x, w13.to(x.dtype), w2.to(x.dtype), topk_weights, topk_ids)
