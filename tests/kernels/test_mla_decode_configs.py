"""The MLA decode kernel under every launch configuration of its table
(``kernels/mla/decode_config.py``) against ``kernels.mla.reference``: DeepSeek-V3's 128
heads and V2-Lite's 16 (so a 64-head block runs with rows masked), ragged lengths, forced
and automatic splits, a 16-bit and an FP8 latent (64 heads); small R and rope so that each
case runs in the interpreter in 1-2 s of CPU (the V3 shape in bf16 is the GPU case at the end). Also
the table itself: its keys, tags, the programs per split and the split cap it implies."""

from __future__ import annotations

import ast

import pytest
import torch

pytest.importorskip("triton")

from kernel_test_utils import DEVICE, assert_close, gpu_only, make_paged_batch, randn

from kernels.mla.decode import (
    _mla_meta,
    choose_mla_splits,
    mla_decode_fwd,
    mla_head_blocks,
    mla_split_cap,
)
from kernels.mla.decode_config import (
    FP32_CONFIG,
    LEGACY_CONFIG,
    MLA_DECODE_TABLE,
    MLA_DECODE_TAGS,
    MLADecodeConfig,
    head_bucket,
    mla_decode_config,
    table_line,
)
from kernels.mla.reference import mla_attention_ref

F16, F32, BF16, E4M3 = torch.float16, torch.float32, torch.bfloat16, torch.float8_e4m3fn
# every configuration of the table, the pre-table one, and the sweep's 8-warp 64-head one
CONFIGS = sorted({c.tag for c in MLA_DECODE_TABLE.values()}
                 | {LEGACY_CONFIG.tag, "64x32x8x2", "32x32x8x2"})


def _batch(lens, r, p, page, seed):
    """An fp32 latent pool ``[S, 1, R + P]`` with every token of each request stored (NaN
    in the slots no request owns) and its paged table."""
    batch = make_paged_batch([n - 1 for n in lens], [1] * len(lens), num_kv_heads=1,
                             head_dim=r + p, page_size=page, dtype=F32, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    for b, n in enumerate(lens):
        slot = batch.req_to_token[int(batch.req_pool_indices[b]), n - 1].long()
        batch.k_buffer[slot] = torch.randn((1, 1, r + p), generator=g).to(DEVICE)
    return batch


def _run(cfg, h, lens, splits, dtype, kv=None, kv_scale=1.0, r=32, p=16, page=16):
    batch = _batch(lens, r, p, page, seed=h + len(lens))
    pool = batch.k_buffer.to(dtype) if kv is None else (batch.k_buffer / kv_scale).to(kv)
    bs, scale = len(lens), 0.3
    q_lat, q_pe = randn((bs, h, r), dtype, 51), randn((bs, h, p), dtype, 52)
    ref = mla_attention_ref(torch.cat([q_lat, q_pe], -1).float(), pool, batch.req_to_token,
                            batch.req_pool_indices.tolist(), batch.seq_lens.tolist(),
                            [1] * bs, scale, r, kv_scale)
    config = MLADecodeConfig.parse(cfg) if cfg else None
    if splits is None:
        cap = mla_split_cap(bs, h, num_sms=8, waves=1, max_kv_splits=8, config=config)
        num = choose_mla_splits(batch.seq_lens, h, cap, num_sms=8, min_chunk=16, config=config)
    else:
        cap, num = splits, torch.full((bs,), splits, dtype=torch.int32, device=DEVICE)
    o = torch.full((bs, h, r), float("nan"), dtype=dtype, device=DEVICE)
    mla_decode_fwd(q_lat, q_pe, pool, o, batch.req_to_token, batch.req_pool_indices,
                   batch.seq_lens, scale, num, cap, kv_scale=kv_scale, config=cfg)
    return o, ref.to(dtype)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("h,lens,splits", [
    pytest.param(128, [70, 1], 2, id="v3-heads-2splits"),
    pytest.param(16, [130, 5, 64, 33], None, id="v2lite-heads-auto"),
])
def test_every_config_matches_reference(cfg, h, lens, splits):
    o, ref = _run(cfg, h, lens, splits, F16)
    assert_close(o, ref, F16, f"mla decode {cfg}, {h} heads")


@pytest.mark.parametrize("cfg", CONFIGS)
def test_every_config_over_an_fp8_latent(cfg):
    # e4m3 holding latent / 0.05, fp32 queries (fp16 dots: fp16's tolerance), 64 heads (one
    # 64-head block, four of 16: the interpreter's time halves against 128)
    o, ref = _run(cfg, 64, [1, 97], 2, F32, kv=E4M3, kv_scale=0.05)
    assert_close(o, ref, F16, f"mla decode {cfg} over e4m3")


def test_table_covers_every_bucket_and_kind():
    assert {k for k in MLA_DECODE_TABLE} == {(b, k) for b in (16, 32, 64, None)
                                             for k in ("16bit", "fp8")}
    assert [head_bucket(h) for h in (1, 16, 17, 32, 64, 65, 128)] == [16, 16, 32, 32, 64,
                                                                      None, None]
    assert mla_decode_config(128) is MLA_DECODE_TABLE[(None, "16bit")]
    assert mla_decode_config(16, kv_fp8=True) is MLA_DECODE_TABLE[(16, "fp8")]
    assert mla_decode_config(128, dtype=F32) is FP32_CONFIG
    assert mla_decode_config(128, kv_fp8=True, dtype=F32) is MLA_DECODE_TABLE[(None, "fp8")]
    # the sweep's line is a dict literal of every key, the picks over the current tags
    line = table_line({(None, "16bit"): "64x32x8x2", (16, "fp8"): "16x64x8x2"})
    picked = ast.literal_eval(line)
    assert picked == {**MLA_DECODE_TAGS, (None, "16bit"): "64x32x8x2",
                      (16, "fp8"): "16x64x8x2"}
    assert line.startswith("{(16, '16bit'): ") and list(picked)[-1] == (None, "fp8")


def test_config_tags_round_trip_and_refuse_bad_values():
    for cfg in [*MLA_DECODE_TABLE.values(), LEGACY_CONFIG, FP32_CONFIG]:
        assert MLADecodeConfig.parse(cfg.tag) == cfg
    assert MLADecodeConfig.parse("legacy") == MLADecodeConfig(16, 32, 4, 2, 1)
    assert MLADecodeConfig.parse("64x64x4x2v2").split_v == 2
    for bad in ("64x64x4", "48x32x4x2", "64x24x4x2", "64x64x4x2v3", "fast"):
        with pytest.raises(ValueError):
            MLADecodeConfig.parse(bad)
    with pytest.raises(ValueError, match="kv_lora_rank"):   # halves of 8 columns
        _mla_meta(16, 16, F16, "cuda", config=MLADecodeConfig(64, 32, 4, 2, 2))


def test_a_table_config_too_big_for_the_device_falls_back(monkeypatch):
    """Triton refuses a launch over the device's shared memory on the host: the table's
    config gives way to the first fallback that fits, for good; a config the caller chose
    does not."""
    from triton.runtime import OutOfResources

    from kernels.mla import decode

    real, seen = decode._mla_decode_stage1_kernel, []

    class SmallDevice:   # sm_89's 99 KB: neither the 64-head rows nor 32-token tiles fit
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["BLOCK_H"], kw["BLOCK_N"]))
                if kw["BLOCK_H"] == 64 or kw["BLOCK_N"] > 16:
                    raise OutOfResources(221184, 101376, "shared memory")
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(decode, "_mla_decode_stage1_kernel", SmallDevice())
    monkeypatch.setattr(decode, "_FITS", {})
    for _ in range(2):
        o, ref = _run(None, 64, [70, 1], 2, F16)
        assert_close(o, ref, F16, "mla decode, the small-shared-memory config")
    assert seen == [(64, 64), (16, 32), (16, 16), (16, 16)]
    with pytest.raises(OutOfResources):
        _run("64x64x4x2v2", 64, [70, 1], 2, F16)
    assert mla_decode_config(128, dtype=F16, device_type="xpu") == LEGACY_CONFIG


def test_programs_per_split_and_the_split_cap():
    v2 = MLADecodeConfig(64, 64, 4, 2, 2)
    assert mla_head_blocks(128, config=v2) == 4          # 2 head blocks x 2 value halves
    assert mla_head_blocks(128, config=LEGACY_CONFIG) == 8
    assert mla_head_blocks(16, config=v2) == 2
    # bs1 fills the 132 SMs (33 splits x 4 programs), capped by max_kv_splits
    assert mla_split_cap(1, 128, 132, 1, 64, config=v2) == 33
    assert mla_split_cap(1, 128, 132, 1, 32, config=v2) == 32
    # 64 requests x 4 programs > 132 SMs: one split; 20 x 4: two
    assert mla_split_cap(64, 128, 132, 1, 32, config=v2) == 1
    assert mla_split_cap(33, 128, 132, 1, 32, config=v2) == 1
    assert mla_split_cap(20, 128, 132, 1, 32, config=v2) == 2
    assert mla_split_cap(4, 16, 132, 1, 64, config=LEGACY_CONFIG) == 33


DECODE_GPU = [
    pytest.param(128, BF16, None, [4096, 1, 1000, 33, 2500, 129], id="v3-bf16"),
    pytest.param(128, BF16, E4M3, [4096, 1, 1000, 33, 2500, 129], id="v3-e4m3"),
    pytest.param(16, BF16, None, [4096, 1, 700], id="v2lite-bf16"),
    pytest.param(16, BF16, E4M3, [4096, 1, 700], id="v2lite-e4m3"),
]


@pytest.mark.parametrize("h,dtype,kv,lens", DECODE_GPU)
@pytest.mark.parametrize("cfg", CONFIGS)
@gpu_only
def test_every_config_at_the_v3_shape_on_the_gpu(cfg, h, dtype, kv, lens):
    o, ref = _run(cfg, h, lens, 8, dtype, kv=kv, r=512, p=64)
    assert_close(o, ref, dtype, f"mla decode {cfg}, {h} heads, latent {kv or dtype}")
