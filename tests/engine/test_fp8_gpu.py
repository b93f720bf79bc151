"""FP8 W8A8 on an accelerator (marker gpu): the ``torch._scaled_mm`` path and the Triton
activation quantizer against the CPU reference, decode graphs against eager, and bf16 vs
FP8 on the Llama-3-8B shape (reported)."""

import pytest
import torch

from engine.device import fp8_linear_backend, resolve_device

pytestmark = pytest.mark.gpu
DEVICE = resolve_device("auto")
if DEVICE == "cpu":
    pytest.skip("needs a CUDA or XPU device", allow_module_level=True)


def _layers(device, dtype):
    from engine.layers.linear import MergedColumnLinear, QKVLinear, RowParallelLinear
    from engine.layers.quantization import Fp8Config, quantization_scope

    g = torch.Generator().manual_seed(0)
    with torch.device(device), quantization_scope(Fp8Config(False, "test")):
        qkv = QKVLinear(512, 64, 8, 2, True, dtype, tp_size=1, tp_rank=0)
        gate_up = MergedColumnLinear(512, [1024, 1024], False, dtype, tp_size=1, tp_rank=0)
        down = RowParallelLinear(1024, 512, False, dtype, tp_size=1, tp_rank=0)
        odd = RowParallelLinear(200, 72, False, dtype, tp_size=1, tp_rank=0)  # not % 16
    for sid, rows in (("q", 512), ("k", 128), ("v", 128)):
        qkv.weight.weight_loader(qkv.weight, torch.randn(rows, 512, generator=g) * 0.02, sid)
    qkv.bias.data.copy_(torch.randn(768, generator=g) * 0.1)
    for i in range(2):
        gate_up.weight.weight_loader(gate_up.weight, torch.randn(1024, 512, generator=g), i)
    down.weight.weight_loader(down.weight, torch.randn(512, 1024, generator=g) * 3)
    odd.weight.weight_loader(odd.weight, torch.randn(72, 200, generator=g))
    return {"qkv": qkv, "gate_up": gate_up, "down": down, "odd": odd}


def test_scaled_mm_path_matches_the_cpu_reference():
    from engine.layers.quantization import process_weights_after_loading
    from kernels.fp8.reference import quantize_rows

    backend = fp8_linear_backend(DEVICE)
    print(f"\nFP8 backend on {DEVICE}: {backend}")
    ref = _layers("cpu", torch.float32)
    got = _layers(DEVICE, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    worst = {}
    for name in ref:
        process_weights_after_loading(ref[name], "cpu")
        process_weights_after_loading(got[name], DEVICE)
        # the GPU layer quantizes bf16-rounded weights, the reference fp32 ones: codes may
        # differ by one e4m3 step where the rounding of the source tips them
        a, b = got[name].weight.cpu().float(), ref[name].weight.float()
        assert float((a != b).float().mean()) < 0.02
        assert bool(((a - b).abs() <= b.abs() * 0.125 + 2 ** -9).all())
        expect = "dequant" if name == "odd" else backend
        assert got[name].fp8_backend == expect
        # 17-64 rows: the FP8-dot Triton kernel where Triton has FP8 tensor cores
        from engine.device import triton_fp8_mma
        assert (got[name].fp8_medium_m is not None) == (expect == "scaled_mm"
                                                        and triton_fp8_mma(DEVICE))
        for m in (1, 7, 64, 300):
            x = torch.randn(m, ref[name].input_size, generator=g)
            x[0, 3] = 40.0  # an outlier channel
            x = x.to(torch.bfloat16)          # both sides see the same bf16 inputs
            y_ref = ref[name](x.float())
            y = got[name](x.to(DEVICE))
            assert y.dtype == torch.bfloat16 and y.shape == y_ref.shape
            err = float((y.float().cpu() - y_ref).abs().max() / y_ref.abs().max())
            worst[name] = max(worst.get(name, 0.0), err)
    print(f"max relative error vs the CPU reference: {worst}")
    assert max(worst.values()) < 1.5e-2  # bf16 output rounding and accumulation order
    # 17-64 rows on the FP8-dot kernel: against quant + _scaled_mm on the same layer's codes
    for name in ("qkv", "gate_up", "down"):
        lay = got[name]
        for m in (17, 40, 64):
            x = (torch.randn(m, lay.input_size, generator=g) * 2).to(DEVICE, torch.bfloat16)
            xq, sx = lay.fp8_quantize(x)
            want = torch._scaled_mm(xq, lay.weight.t(), scale_a=sx,
                                    scale_b=lay.weight_scale.unsqueeze(0),
                                    out_dtype=torch.bfloat16).float()
            if lay.bias is not None:
                want = want + lay.bias.float()
            y = lay(x).float()
            err = float((y - want).norm() / want.norm())
            assert err < 5e-3, (name, m, err)   # bf16 rounding of both outputs, sum order
    # the Triton quantizer writes the reference's codes and scales
    x = (torch.randn(33, 4096, generator=g) * 3).to(DEVICE, torch.bfloat16)
    q, s = got["qkv"].fp8_quantize(x)
    rq, rs = quantize_rows(x)
    assert torch.allclose(s, rs, rtol=3e-7, atol=0)  # Triton's division: within 2 ulp
    a, b = q.float(), rq.float()
    mismatch = float((a != b).float().mean())
    print(f"Triton quantizer: {mismatch:.2e} of the codes differ from torch's")
    assert mismatch < 1e-4
    assert bool(((a - b).abs() <= b.abs() * 0.125 + 1e-30).all())  # one e4m3 step at most


def test_decode_graphs_with_fp8_layers_match_eager():
    """Same tokens with the decode graph as without (8 requests decode together, so the
    graph's batch is the eager batch and the matmul kernels are the same)."""
    from engine import LLM, SamplingParams
    from engine.loader.loader import config_dir

    outs = {}
    for graphs in (False, True):
        llm = LLM(model_path=config_dir("llama-tiny"), load_format="dummy", device=DEVICE,
                  dtype="bfloat16", quantization="fp8", max_total_tokens=4096,
                  disable_cuda_graph=not graphs, enable_xpu_graph=True,
                  disable_piecewise_graph=True,
                  disable_overlap_schedule=True)
        assert (llm.runner.graph_runner is not None) == graphs
        lin = llm.runner.model.model.layers[0].self_attn.qkv_proj
        assert lin.weight.dtype == torch.float8_e4m3fn
        assert lin.fp8_backend == fp8_linear_backend(DEVICE)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, llm.vocab_size, (n,), generator=g).tolist()
                   for n in (3, 17, 70, 9, 33, 129, 1, 50)]
        sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, sp)]
        llm.shutdown()
    agree = sum(a == b for a, b in zip(outs[False], outs[True]))
    print(f"\nFP8 decode graphs vs eager: {agree}/8 prompts identical over 24 tokens")
    assert outs[True] == outs[False]


def test_bf16_vs_fp8_on_the_llama3_8b_shape():
    """Reported, not a quality bar: dummy weights have no real next-token preferences."""
    from bench.quant_parity import main
    from engine.loader.loader import CONFIGS_DIR

    rep = main(["--model-path", str(CONFIGS_DIR / "llama-3-8b.json"), "--load-format", "dummy",
                "--device", DEVICE, "--steps", "16", "--num-prompts", "8"])
    assert rep["reference_dtype"] == "bfloat16" and rep["prompts"] == "random"
    print(f"\nLlama-3-8B shape, dummy weights, bf16 vs FP8: mean KL {rep['mean_kl']:.3e}, "
          f"max {rep['max_kl']:.3e}, teacher-forced top-1 {rep['top1_match']:.3f}, "
          f"{rep['prompts_fully_agreed']}/8 prompts agree on 16 tokens")
    assert rep["mean_kl"] == rep["mean_kl"] and rep["mean_kl"] < 1.0  # finite, not broken
