"""The kernels' launch tables: CUDA's entries are the tuned ones (pinned here, so that an XPU
change cannot move them) and XPU's follow ``kernels/launch.py`` (twice the warps of a
``tl.dot`` kernel, 2 stages), the FP8 small-M kernel does not split K on XPU, and decode
attention splits more per Xe core. Pure table lookups: nothing is compiled or launched."""

from __future__ import annotations

import torch

from kernels import decode_attention as da
from kernels import extend_attention as ea
from kernels.fp8.fp8_triton import (
    medium_m_config,
    small_m_config,
    split_k_trusted,
)
from kernels.launch import dot_kernel_options

BF16 = torch.bfloat16


def test_dot_kernel_rule():
    assert dot_kernel_options(4, 3, "cuda") == {"num_warps": 4, "num_stages": 3}
    assert dot_kernel_options(4, 3, "cpu") == {"num_warps": 4, "num_stages": 3}
    assert dot_kernel_options(4, 3, "xpu") == {"num_warps": 8, "num_stages": 2}
    assert dot_kernel_options(32, 4, "xpu")["num_warps"] == 32


def test_decode_stage1_table():
    assert da._stage1_meta(4, 128, BF16, "cuda")[1] == {"num_warps": 4, "num_stages": 2}
    assert da._stage1_meta(4, 128, torch.float32, "cuda")[1] == {"num_warps": 8,
                                                                  "num_stages": 2}
    assert da._stage1_meta(4, 128, BF16, "xpu")[1] == {"num_warps": 8, "num_stages": 2}
    # the MHA path has no tl.dot: 32-lane sub-groups on XPU, CUDA's warps
    assert da._stage1_meta(1, 128, BF16, "xpu")[1] == da._stage1_meta(1, 128, BF16, "cuda")[1]
    # overrides (benchmarks) win everywhere
    assert da._stage1_meta(4, 128, BF16, "xpu", num_warps=2)[1]["num_warps"] == 2
    assert da._stage1_meta(4, 128, BF16, "xpu")[0] == da._stage1_meta(4, 128, BF16, "cuda")[0]


def test_extend_table():
    assert ea._extend_meta(4, 128, BF16, "cuda")[1] == {"num_warps": 8, "num_stages": 2}
    assert ea._extend_meta(4, 64, BF16, "cuda")[1] == {"num_warps": 4, "num_stages": 2}
    assert ea._extend_meta(4, 128, BF16, "xpu")[1] == {"num_warps": 16, "num_stages": 2}
    assert ea._extend_meta(4, 128, BF16, "xpu", num_warps=4)[1]["num_warps"] == 4


def test_decode_split_defaults():
    assert da.default_waves("cuda") == 1 and da.default_waves("xpu") == 4
    assert da.default_waves("cpu") == 1
    lens = torch.full((2,), 4096, dtype=torch.int32)
    # a B580 (20 Xe cores), 2 requests x 8 KV heads: 2 splits with 1 wave, 5 with 4
    assert da.choose_num_kv_splits(lens, 8, 16, 20).tolist() == [2, 2]
    assert da.choose_num_kv_splits(lens, 8, 16, 20, waves=da.default_waves("xpu")).tolist() \
        == [5, 5]


def test_attention_backend_takes_the_device_default_waves():
    from engine.attention.triton import TritonAttnBackend

    assert TritonAttnBackend(8, 2, 64, device="cuda").waves == 1
    assert TritonAttnBackend(8, 2, 64, device="xpu").waves == 4
    assert TritonAttnBackend(8, 2, 64, device="xpu", waves=2).waves == 2


def test_fp8_small_m_table():
    assert split_k_trusted("cuda") and not split_k_trusted("xpu")
    cuda = small_m_config(1, 4096, 4096)
    assert cuda == small_m_config(1, 4096, 4096, "cuda") == dict(
        USE_DOT=True, SPLIT_K=8, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4,
        num_stages=4)
    xpu = small_m_config(1, 4096, 4096, "xpu")
    assert xpu["SPLIT_K"] == 1 and xpu["num_warps"] == 8 and xpu["num_stages"] == 2
    assert {k: v for k, v in xpu.items() if k not in ("SPLIT_K", "num_warps", "num_stages")} \
        == {k: v for k, v in cuda.items() if k not in ("SPLIT_K", "num_warps", "num_stages")}
    assert medium_m_config(32, 1024, 4096)["SPLIT_K"] == 4
    assert medium_m_config(32, 1024, 4096, "xpu")["SPLIT_K"] == 1
