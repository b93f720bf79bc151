"""``SparseMoeBlock`` with its shared expert's gate folded into the router's GEMM (issues 45,
49) and the Triton experts: the routing kernels read the strided ``[T, E]`` view of the
folded logits (the self-routing decode kernels at M=1, ``fused_topk`` past it), the output
matches the unfolded block, and a layer launches 2 fewer kernels (the gate's GEMM and the
multiply go, the add becomes ``addcmul``; on a GPU 3: the N = 1 GEMM was cuBLAS's two).
fp32 in the interpreter; on a GPU the Qwen3.5-35B-A3B shapes in bf16 (the fused GEMM's
logits against the separate GEMMs', the block in fp32 so that no routing tie flips) and a
captured decode step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, TOL, gpu_only, rel_err

from engine.layers.moe import SparseMoeBlock, triton_fused_moe

F32, BF16 = torch.float32, torch.bfloat16


class _Shared(nn.Module):
    """A SwiGLU shared expert x [T, H] -> [T, H] (two GEMMs and the activation)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(2 * inter, hidden, dtype=dtype),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(hidden, inter, dtype=dtype), requires_grad=False)

    def forward(self, x):
        g, u = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.down)


def _blocks(hidden: int, experts: int, top_k: int, inter: int, dtype: torch.dtype,
            seed: int = 0) -> tuple[SparseMoeBlock, SparseMoeBlock]:
    """(unfolded, folded) copies of one random block on DEVICE with the Triton impl."""
    torch.manual_seed(seed)
    block = SparseMoeBlock(hidden, experts, top_k, inter, True, dtype,
                           shared_expert=_Shared(hidden, inter, dtype),
                           shared_expert_gate=True)
    for p in block.parameters():
        p.data.normal_(0, 0.2 if hidden < 256 else 0.02)
    block = block.to(DEVICE)
    block.experts.impl = triton_fused_moe()
    folded = copy.deepcopy(block)
    folded.experts.impl = block.experts.impl
    assert folded.fold_shared_gate()
    return block, folded


@pytest.mark.parametrize("m", [1, 20])
def test_folded_block_matches_and_launches_two_fewer(m):
    from bench.launch_count import count_launches

    plain, folded = _blocks(32, 8, 2, 32, F32)
    x = torch.randn(m, 32, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    with count_launches() as seen_plain:
        ref = plain(x)
    with count_launches() as seen_folded:
        out = folded(x)
    assert rel_err(out, ref) < TOL[F32]
    assert seen_folded.total == seen_plain.total - 2, (seen_plain.names, seen_folded.names)


@gpu_only
@pytest.mark.parametrize("m", [1, 64])
def test_gpu_folded_logits_and_block_qwen35_shapes(m):
    """Qwen3.5-35B-A3B's MoE shapes (H 2048, 256 experts, top-8, I 512)."""
    plain, folded = _blocks(2048, 256, 8, 512, BF16, seed=m)
    x = (torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)) * 0.5).to(DEVICE)
    xb = x.to(BF16)
    logits = F.linear(xb, folded.router_gate_weight)
    assert rel_err(logits[:, :256], plain.gate(xb)) < TOL[BF16]
    assert rel_err(logits[:, 256:257], plain.shared_expert_gate(xb)) < TOL[BF16]
    plain32, folded32 = plain.float(), copy.deepcopy(plain).float()
    folded32.experts.impl = plain.experts.impl
    assert folded32.fold_shared_gate()
    assert rel_err(folded32(x), plain32(x)) < 1e-4


@gpu_only
def test_gpu_folded_block_graph_capture():
    """The folded decode step captured once and replayed on other inputs (against the
    folded block run eagerly; against the unfolded one loosely: the N = 24 and N = 16 GEMMs
    may round a bf16 logit apart and flip a near-tie)."""
    from engine import device as devlib

    graph_cls = devlib.graph_class(DEVICE)
    if graph_cls is None:
        pytest.skip("no device graphs here")
    plain, folded = _blocks(256, 16, 4, 128, BF16, seed=7)
    g = torch.Generator().manual_seed(8)
    inputs = [torch.randn(1, 256, generator=g).to(BF16).to(DEVICE) for _ in range(3)]
    x_buf = inputs[0].clone()
    stream = devlib.stream_class(DEVICE)()
    stream.wait_stream(devlib.current_stream(DEVICE))
    with devlib.stream_context(DEVICE, stream):
        folded(x_buf)                                  # compile outside the capture
    devlib.current_stream(DEVICE).wait_stream(stream)
    graph = graph_cls()
    with devlib.graph_context(DEVICE, graph):
        out = folded(x_buf)
    for x in inputs[1:]:
        x_buf.copy_(x)
        graph.replay()
        devlib.synchronize(DEVICE)
        assert rel_err(out, folded(x)) < TOL[F32]       # the same kernels, eagerly
        assert rel_err(out, plain(x)) < 0.1             # a bf16 routing tie may flip
