"""Triton extend (prefix + causal new tokens) attention vs ``extend_attention_ref``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import (
    DEVICE,
    GPU_MARKS,
    assert_close,
    make_extend_inputs,
    make_paged_batch,
    nan_like,
    randn,
)

from kernels.extend_attention import extend_attention_fwd
from kernels.reference import extend_attention_ref

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16

# (group, num_kv_heads, head_dim, page_size, dtype, prefix_lens, extend_lens), pruned:
# GQA 1/3/8, head dims 64/128 and 80 (padded), pages 1/16, plain prefill and cached
# prefixes, extend lengths of 1, below / across / not a multiple of the 32/64 blocks, a
# request with nothing to extend, batch 1 and several.
CASES = [
    pytest.param(1, 2, 64, 1, F32, [0], [100], id="mha-d64-prefill-bs1-f32"),
    pytest.param(3, 1, 64, 16, F16, [0, 37, 130], [65, 1, 20], id="g3-d64-p16-f16"),
    pytest.param(8, 1, 128, 16, F32, [70, 0], [30, 40], id="g8-d128-p16-f32"),
    pytest.param(3, 1, 128, 1, F16, [300], [129], id="g3-d128-p1-f16-bs1"),
    pytest.param(4, 1, 80, 1, F16, [10, 0, 63], [3, 50, 1], id="g4-d80-p1-f16"),
    pytest.param(8, 1, 64, 16, F16, [0, 0, 0], [17, 33, 70], id="g8-d64-prefill-f16"),
    pytest.param(1, 3, 128, 16, F16, [5, 200], [0, 66], id="mha-d128-empty-ext-f16"),
    pytest.param(8, 2, 64, 1, F32, [129], [1], id="g8-d64-ext1-f32"),
    pytest.param(4, 8, 128, 16, BF16, [0, 1000, 3000, 17], [2048, 333, 1, 700],
                 id="g4-d128-bf16-big", marks=GPU_MARKS),
    pytest.param(3, 3, 64, 1, BF16, [513], [1025], id="g3-d64-bf16", marks=GPU_MARKS),
    # Gemma 4's heads: 256 on its sliding layers, 512 on its global layers
    pytest.param(8, 1, 256, 16, BF16, [0, 700], [1024, 33], id="g8-d256-bf16-gemma4",
                 marks=GPU_MARKS),
    pytest.param(8, 1, 512, 16, BF16, [0, 700], [1024, 33], id="g8-d512-bf16-gemma4-global",
                 marks=GPU_MARKS),
]


def _make(group, hkv, d, page, dtype, prefix_lens, extend_lens, seed):
    return make_extend_inputs(group, hkv, d, page, dtype, prefix_lens, extend_lens, seed)


@pytest.mark.parametrize("group,hkv,d,page,dtype,prefix_lens,extend_lens", CASES)
def test_extend_matches_reference(group, hkv, d, page, dtype, prefix_lens, extend_lens):
    batch, q, k, v, ext, starts = _make(group, hkv, d, page, dtype, prefix_lens, extend_lens,
                                        seed=sum(extend_lens) + d)
    common = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
              batch.seq_lens, ext, starts, d ** -0.5)
    # The reference concatenates pool and new K/V in k's dtype; it never reads the (NaN)
    # pool slots of the new tokens, and neither may the kernel.
    ref = torch.empty_like(q)
    extend_attention_ref(q, k, v, ref, *common)
    o = nan_like(q)
    extend_attention_fwd(q, k, v, o, *common, max_extend_len=max(extend_lens))
    assert_close(o, ref, dtype, "extend")


def test_extend_strided_inputs_and_oversized_grid():
    """q/k/v sliced out of one fused qkv tensor; max_extend_len larger than needed."""
    group, hkv, d, dtype = 3, 2, 64, F16
    prefix_lens, extend_lens = [40, 0], [70, 9]
    batch = make_paged_batch(prefix_lens, extend_lens, num_kv_heads=hkv, head_dim=d,
                             page_size=16, dtype=dtype, seed=9)
    t, hq = sum(extend_lens), group * hkv
    qkv = randn((t, (hq + 2 * hkv) * d), dtype, 10)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    ext = torch.tensor(extend_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 70], dtype=torch.int32, device=DEVICE)
    common = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
              batch.seq_lens, ext, starts, d ** -0.5)
    ref = torch.empty((t, hq, d), dtype=dtype, device=DEVICE)
    extend_attention_ref(q, k, v, ref, *common)
    o = torch.full((t, hq, d), float("nan"), dtype=dtype, device=DEVICE)
    extend_attention_fwd(q, k, v, o, *common, max_extend_len=200)
    assert_close(o, ref, dtype, "extend strided")


def test_extend_rejects_bad_blocks_and_shapes():
    batch, q, k, v, ext, starts = _make(1, 1, 64, 1, F32, [0], [8], seed=1)
    common = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
              batch.seq_lens, ext, starts, 0.125)
    with pytest.raises(ValueError):
        extend_attention_fwd(q, k, v, nan_like(q), *common, max_extend_len=8, block_m=48,
                             block_n=32)
    with pytest.raises(ValueError):
        extend_attention_fwd(q, k[:, :, :32], v, nan_like(q), *common, max_extend_len=8)


@pytest.mark.parametrize("block_m,block_n", [(64, 32), (32, 16)])
def test_extend_block_overrides(block_m, block_n):
    """BLOCK_M > BLOCK_N: several diagonal tiles per query block, partly fully masked."""
    dtype, d = F16, 64
    batch, q, k, v, ext, starts = _make(2, 2, d, 16, dtype, [45, 0], [100, 37], seed=4)
    common = (batch.k_buffer, batch.v_buffer, batch.req_to_token, batch.req_pool_indices,
              batch.seq_lens, ext, starts, d ** -0.5)
    ref = torch.empty_like(q)
    extend_attention_ref(q, k, v, ref, *common)
    o = nan_like(q)
    extend_attention_fwd(q, k, v, o, *common, max_extend_len=100, block_m=block_m,
                         block_n=block_n)
    assert_close(o, ref, dtype, f"extend {block_m}x{block_n}")
