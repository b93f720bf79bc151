"""Count the kernel launches of a piece of the forward pass on the CPU (Triton interpreter).

A decode step on a GPU is captured in a graph, so its cost at small batch is the number of
kernels times a few microseconds each; this tool counts them without a GPU:

* Triton launches: every ``kernel[grid](...)`` (``triton.runtime.jit.KernelInterface``),
  compiled or interpreted, by kernel name;
* torch ops that would be a kernel on a GPU: every aten op dispatched outside a Triton
  launch, less views, allocations and other metadata-only ops (a cuBLAS GEMM counts once,
  like the router's ``F.linear``).

``python -m bench.launch_count`` prints one MoE layer (Qwen3-30B-A3B's and Mixtral's
routing on small widths), one LoRA Llama layer and one Qwen3.5 Gated DeltaNet layer's decode
step at batch 1 and 8, the fused paths against the unfused ones
(``FERRY_MOE_DECODE_MAX_M=0``, ``FERRY_LORA_FUSED_DECODE=0``,
``FERRY_GDN_FUSED_PROLOGUE=0``). Run it with ``TRITON_INTERPRET=1`` set (``main`` sets it before importing the kernels).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass, field

#: aten ops that launch nothing on a GPU (views, allocations, metadata)
_NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view",
    "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "as_strided", "slice",
    "select", "unsqueeze", "squeeze", "detach", "alias", "lift_fresh", "split",
    "split_with_sizes", "unbind", "narrow", "_to_copy_noop", "is_same_size", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "_local_scalar_dense", "unflatten",
}


@dataclass
class Launches:
    """What :func:`count_launches` saw: ``names`` counts each kernel or op once per launch."""

    names: Counter = field(default_factory=Counter)
    triton: int = 0
    torch: int = 0

    @property
    def total(self) -> int:
        return self.triton + self.torch


@contextlib.contextmanager
def count_launches():
    """Count the launches inside the ``with`` block (yields a :class:`Launches`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.jit import KernelInterface

    seen = Launches()
    inside = [0]

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__.rstrip("_")
            if not inside[0] and name not in _NO_KERNEL:
                seen.torch += 1
                seen.names["aten." + name] += 1
            return func(*args, **(kwargs or {}))

    original = KernelInterface.__getitem__

    def launcher(self, grid):
        run = original(self, grid)

        def counted(*args, **kwargs):
            seen.triton += 1
            seen.names[getattr(self, "__name__", None) or type(self).__name__] += 1
            inside[0] += 1
            try:
                return run(*args, **kwargs)
            finally:
                inside[0] -= 1
        return counted

    KernelInterface.__getitem__ = launcher
    try:
        with _Ops(), torch.no_grad():
            yield seen
    finally:
        KernelInterface.__getitem__ = original


def _moe_layer(m: int, num_experts: int, top_k: int, fused: bool) -> Launches:
    import torch

    from engine.layers.moe import SparseMoeBlock, triton_fused_moe
    from kernels.moe import fused_moe_decode

    torch.manual_seed(0)
    block = SparseMoeBlock(64, num_experts, top_k, 32, True, torch.float32)
    for p in block.parameters():
        p.data.normal_(0, 0.1)
    block.experts.impl = triton_fused_moe()
    x = torch.randn(m, 64)
    saved = fused_moe_decode.DECODE_MAX_M
    fused_moe_decode.DECODE_MAX_M = saved if fused else 0
    try:
        block(x)                                   # warm-up (config lookups, caches)
        with count_launches() as seen:
            block(x)
    finally:
        fused_moe_decode.DECODE_MAX_M = saved
    return seen


def _lora_layer(m: int, fused: bool) -> Launches:
    import torch

    from kernels.lora import lora_triton

    g = torch.Generator().manual_seed(0)
    seen_all = Launches()
    saved = lora_triton.FUSED_DECODE
    lora_triton.FUSED_DECODE = fused
    try:
        # a Llama layer's four LoRA projections (qkv: 3 parts, o, gate_up: 2 parts, down)
        for parts, k in (([32, 16, 16], 64), ([64], 64), ([96, 96], 64), ([64], 96)):
            n = sum(parts)
            a = torch.randn(len(parts), 4, 16, k, generator=g) / 8
            b = torch.randn(4, 16, n, generator=g) / 8
            cols = [(sum(parts[:i]), p) for i, p in enumerate(parts)]
            x, y = torch.randn(m, k, generator=g), torch.zeros(m, n)
            seg = torch.arange(m, dtype=torch.int32)
            slots = (seg % 5 - 1).to(torch.int32)          # mixed adapters and base rows
            ones = torch.ones(m, dtype=torch.int32)
            with count_launches() as seen:
                lora_triton.lora_apply_triton(x, y, a, b, cols, seg, ones, slots, 1)
            seen_all.triton += seen.triton
            seen_all.torch += seen.torch
            seen_all.names.update(seen.names)
    finally:
        lora_triton.FUSED_DECODE = saved
    return seen_all


def _gdn_layer(m: int, fused: bool) -> Launches:
    """One Qwen3.5 Gated DeltaNet layer's decode step (split projections, small widths) as
    on a GPU: ferry's Triton recurrent update, and the fused prologue or the torch one."""
    import torch

    import engine.layers.gated_deltanet as gdn
    from engine.kv.state_pool import RecurrentStatePool, StateShape
    from kernels.linear_attention.decode_triton import recurrent_gated_delta_rule_update_triton

    torch.manual_seed(0)
    dims = gdn.GatedDeltaNetDims(64, 2, 4, 16, 16, 4, 1e-6)
    layer = gdn.GatedDeltaNet(dims, torch.float32, split_projections=True, tp_size=1,
                              tp_rank=0)
    for p in layer.parameters():
        p.data.normal_(0, 0.1)
    pool = RecurrentStatePool(m + 1, [StateShape(dims.conv_dim, dims.conv_width,
                                                 dims.num_v_heads, dims.k_head_dim,
                                                 dims.v_head_dim)], torch.float32, "cpu")
    state = gdn.LinearStateBatch(pool.conv_states[0], pool.recurrent_states[0],
                                 torch.arange(m, 0, -1), list(range(m + 1)), True)
    x = torch.randn(m, 64)
    saved = gdn.fused_prologue, gdn.recurrent_gated_delta_rule_update
    gdn.fused_prologue = lambda device: fused
    gdn.recurrent_gated_delta_rule_update = recurrent_gated_delta_rule_update_triton
    try:
        layer(x, state)                            # warm-up
        with count_launches() as seen:
            layer(x, state)
    finally:
        gdn.fused_prologue, gdn.recurrent_gated_delta_rule_update = saved
    return seen


def main() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    rows = []
    for label, e, k in (("Qwen3-30B-A3B routing (E=128, top-8)", 128, 8),
                        ("Mixtral routing (E=8, top-2)", 8, 2)):
        for m in (1, 8):
            on, off = _moe_layer(m, e, k, True), _moe_layer(m, e, k, False)
            rows.append((f"MoE layer, {label}, M={m}", on, off))
    for m in (1, 8):
        rows.append((f"LoRA Llama layer (4 projections), M={m}", _lora_layer(m, True),
                     _lora_layer(m, False)))
    for m in (1, 8):
        rows.append((f"Qwen3.5 Gated DeltaNet layer decode, M={m}", _gdn_layer(m, True),
                     _gdn_layer(m, False)))
    for label, on, off in rows:
        print(f"{label}: fused {on.total} launches ({on.triton} Triton + {on.torch} torch), "
              f"unfused {off.total} ({off.triton} + {off.torch})")
        print(f"    fused:   {dict(on.names)}")
        print(f"    unfused: {dict(off.names)}")


if __name__ == "__main__":
    main()
