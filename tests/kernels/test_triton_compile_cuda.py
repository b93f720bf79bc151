"""The kernels compile to NVIDIA SASS (sm_80, sm_90) on a machine without a GPU.

The interpreter runs kernel code as NumPy and accepts programs the compiler rejects (layout
or dtype rules of ``tl.dot``, constexpr misuse, ...). This test lowers the launch variants
that the wrappers would pick (their ``*_meta`` helpers) through Triton's real NVIDIA
pipeline, ptxas included, in a subprocess without ``TRITON_INTERPRET``. Pointer and stride
arguments carry the 16-byte divisibility the JIT would infer at launch time. On a GPU machine
the other tests compile the kernels for real, so this one is skipped there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from kernel_test_utils import ON_GPU

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels import decode_attention as da, extend_attention as ea, fused_ops as fo, kv_store as ks
    from kernels.mla import decode as mlad, decode_config as mlac, prefill as mlap
    from kernels.moe import fused_moe_mxfp4 as mx, fused_moe_mxfp4_gemv as mxg

    TY = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

    def compile_one(kernel, ptr_types, constexprs, options, arch):
        sig, attrs = {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in ptr_types:
                sig[name] = "*" + ptr_types[name]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in ("qk_scale", "eps", "cap_log2", "q_scale", "v_scale", "k_inv", "v_inv",
                          "kv_scale", "alpha", "limit"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
                if name.startswith("stride") and name not in ("stride_r2t", "stride_sn"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(kernel, sig, constexprs, attrs)
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)

    # the attention variants' switches: all off (the default build; sinks_ptr is None, a
    # constexpr, as at launch) or all on
    OFF = dict(SLIDING=False, SOFTCAP=False, HAS_SINKS=False, sinks_ptr=None)
    ON = dict(SLIDING=True, SOFTCAP=True, HAS_SINKS=True)

    def sinks(var):
        return {} if "sinks_ptr" in var else {"sinks_ptr": "fp32"}

    def decode(dtype, group, d, arch, var=OFF, kv=None):
        t = TY[dtype]
        ptrs = dict(q_ptr=t, k_buf=kv or t, v_buf=kv or t, req_to_token="i32", req_pool_indices="i64",
                    seq_lens="i32", num_kv_splits="i32", part_o="fp32", part_lse="fp32",
                    o_ptr=t, **sinks(var))
        meta, opts = da._stage1_meta(group, d, dtype, "cuda", kv_fp8=kv is not None)
        compile_one(da._decode_stage1_kernel, ptrs, {**meta, **var}, opts, arch)
        meta, opts = da._stage2_meta(d, 16)
        var2 = {k: var[k] for k in ("HAS_SINKS", "sinks_ptr") if k in var}
        compile_one(da._decode_stage2_kernel, dict(part_o="fp32", part_lse="fp32", o_ptr=t,
                    num_kv_splits="i32", **sinks(var)), {**meta, **var2}, opts, arch)

    def extend(dtype, group, d, arch, var=OFF, kv=None):
        t = TY[dtype]
        ptrs = dict(q_ptr=t, k_ptr=t, v_ptr=t, o_ptr=t, k_buf=kv or t, v_buf=kv or t, req_to_token="i32",
                    req_pool_indices="i64", seq_lens="i32", extend_seq_lens="i32",
                    extend_start_loc="i32", **sinks(var),
                    **({"key_limit": "i32"} if var.get("KEY_LIMIT") else {}))
        meta, opts = ea._extend_meta(group, d, dtype, "cuda", kv_fp8=kv is not None)
        compile_one(ea._extend_kernel, ptrs, {**meta, **var}, opts, arch)

    def mla(dtype, arch, kv=None, config=None):
        # DeepSeek-V3's shape: R 512, rope 64, nope 128, v 128; kv: an FP8 latent pool;
        # config: a launch config of the decode (None: the table's for 128 heads)
        t = TY[dtype]
        meta, opts = mlad._mla_meta(512, 64, dtype, "cuda", kv_fp8=kv is not None,
                                    config=config)
        k = compile_one(mlad._mla_decode_stage1_kernel, dict(
            q_lat=t, q_pe=t, latent=kv or t, req_to_token="i32", req_pool_indices="i64",
            seq_lens="i32", num_kv_splits="i32", part_o="fp32", part_lse="fp32", o_ptr=t),
            meta, opts, arch)
        # the H200's 227 KB of shared memory a block (the launch would refuse more)
        assert arch != 90 or k.metadata.shared <= 232448, (config, kv, k.metadata.shared)
        if kv is not None or config is not None:
            return
        meta, opts = mlap._prefill_meta(128, 64, 128, dtype, "cuda", None, None, None)
        compile_one(mlap._mla_prefill_kernel, dict(
            q_nope_ptr=t, q_pe_ptr=t, k_nope_ptr=t, k_pe_ptr=t, v_ptr=t, o_ptr=t,
            seq_lens="i32", ext_lens="i32", q_start_loc="i32", kv_start_loc="i32"),
            meta, opts, arch)

    for arch in (90, 80):
        mla(torch.bfloat16, arch)
        decode(torch.bfloat16, 4, 128, arch)
        extend(torch.bfloat16, 4, 128, arch)
    decode(torch.float32, 1, 64, 90)        # elementwise (MHA) path, ieee fp32 dots
    decode(torch.bfloat16, 4, 128, 90, ON)  # sliding window, soft-cap and sinks
    decode(torch.float16, 1, 64, 90, ON)
    extend(torch.bfloat16, 4, 128, 90, ON)
    # per-row key limits (Gemma 3's bidirectional image spans), alone and with the variants
    extend(torch.bfloat16, 2, 128, 90, dict(OFF, KEY_LIMIT=True))
    extend(torch.bfloat16, 2, 128, 90, dict(ON, KEY_LIMIT=True))
    decode(torch.float16, 3, 80, 90)        # padded head_dim
    extend(torch.float32, 8, 64, 90)
    extend(torch.float16, 3, 96, 90)
    # FP8 KV caches (sm_89+: Triton has no e4m3 below): the KV_FP8 paths, plain and variants
    decode(torch.bfloat16, 4, 128, 90, kv="fp8e4nv")
    decode(torch.bfloat16, 4, 128, 90, ON, kv="fp8e4nv")
    decode(torch.float16, 1, 64, 90, kv="fp8e5")
    extend(torch.bfloat16, 4, 128, 90, kv="fp8e4nv")
    extend(torch.bfloat16, 4, 128, 90, ON, kv="fp8e5")
    mla(torch.bfloat16, 90, kv="fp8e4nv")   # the MLA decode over an FP8 latent pool
    # every other launch config of the MLA decode's table, bf16 and FP8 latents, and the one
    # a device with less shared memory falls back to (sm_80)
    for key, cfg in mlac.MLA_DECODE_TABLE.items():
        if cfg != mlac.MLA_DECODE_TABLE[(None, key[1])]:
            mla(torch.bfloat16, 90, "fp8e4nv" if key[1] == "fp8" else None, cfg)
    for cfg in mlac.SMALL_SMEM_CONFIGS:
        mla(torch.bfloat16, 80, None, cfg)
    for pool in ("bf16", "fp8e4nv"):
        compile_one(ks._store_kv_kernel, dict(k_buf=pool, v_buf=pool, loc_ptr="i64",
                    k_ptr="fp32", v_ptr="fp32"),
                    dict(NUM_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128,
                         KV_FP8=pool != "bf16"), {"num_warps": 4}, 90)
    compile_one(fo._rms_norm_kernel, dict(x_ptr="bf16", res_ptr="bf16", w_ptr="bf16",
                out_ptr="bf16", res_out_ptr="bf16"),
                dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True), {"num_warps": 8}, 90)
    compile_one(fo._silu_and_mul_kernel, dict(x_ptr="bf16", out_ptr="bf16"),
                dict(INTER=14336, BLOCK=1024), {"num_warps": 4}, 90)
    # gpt-oss's MXFP4 MoE GEMM: the decode tile (a partial last K step) and a prefill tile
    for bm, bn, bk, warps, stages in ((16, 64, 256, 4, 4), (128, 128, 128, 8, 3)):
        compile_one(mx._moe_gemm_oai_kernel, dict(
            a_ptr="bf16", b_ptr="u8", s_ptr="u8", bias_ptr="bf16", c_ptr="bf16", w_ptr="fp32",
            sorted_ptr="i32", expert_ids_ptr="i32", num_post_ptr="i32"),
            dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, MUL_ROUTED_WEIGHT=True, MXFP4=True,
                 HAS_BIAS=True, EVEN_K=False, DOT_PREC=None),
            {"num_warps": warps, "num_stages": stages}, 90)
    # its GEMV path (M <= 4): the default tiles at M = 1 and 4, ids given and self-routed
    for m in (1, 4):
        t = mxg.gemv_tiles(m, 4, 2880, 2880)
        for route in (False, True):
            common = dict(TOP_K=4, ROUTE=route, RENORM=True, BLOCK_E=128, BLOCK_P=4,
                          HAS_BIAS=True)
            bn, bk, warps = t["up"]
            compile_one(mxg._gemv_gate_up_kernel, dict(
                x_ptr="bf16", b_ptr="u8", s_ptr="u8", bias_ptr="bf16", ids_ptr="i32",
                logits_ptr="bf16", act_ptr="bf16"),
                dict(common, ACT=1, BLOCK_N=bn, BLOCK_K=bk), {"num_warps": warps}, 90)
            bn, bk, warps = t["down"]
            compile_one(mxg._gemv_down_kernel, dict(
                act_ptr="bf16", b_ptr="u8", s_ptr="u8", bias_ptr="bf16", ids_ptr="i32",
                tw_ptr="fp32", logits_ptr="bf16", out_ptr="bf16"),
                dict(common, BLOCK_N=bn, BLOCK_K=bk), {"num_warps": warps}, 90)
    print("COMPILED OK")
''')


@pytest.mark.skipif(ON_GPU, reason="the GPU tests compile the kernels for real")
def test_kernels_compile_for_nvidia_targets():
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backend registry")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend (e.g. triton-xpu)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"   # silence the 3.9 default-change warning
    res = subprocess.run([sys.executable, "-c", SCRIPT], check=False, cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "COMPILED OK" in res.stdout, res.stderr[-4000:]
