"""``ferry serve``'s start-up checks (issue 41, item 4): every error a flag or a checkpoint's
config can cause is one line ``ferry serve: error: ...`` and exit code 2, before any process
starts (``engine/executor/preflight.py`` after ``check_environment``). Through ``serve()``
with ``launch_server`` stubbed to fail the test if it is reached.

Before the checks, the LoRA, MoE + quantization and architecture cases were found only in
the engine process after the model loaded (a traceback, exit 1), and ``--max-loras-per-batch``
without adapters was accepted and ignored. The draft path, GGUF path, tensor-parallel shape
and ``--max-lora-rank``/``--max-loaded-loras`` cases were refused early already; they are
here so that the survey stays covered.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import engine

TINY_LLAMA = os.path.join(os.path.dirname(engine.__file__), "configs", "llama-tiny.json")
BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu"}
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                 intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, head_dim=32)
MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
               intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
FP8_CKPT = {"quant_method": "fp8", "activation_scheme": "dynamic"}
LORA_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16,
               "target_modules": ["q_proj", "v_proj"]}


def _config(root, name: str, **fields) -> str:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**BASE, **fields}))
    return str(d)


def _adapter(root, name: str, weights: bool = True, **cfg) -> str:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({**LORA_CONFIG, **cfg}))
    if weights:
        (d / "adapter_model.safetensors").write_bytes(b"")  # not read by the checks
    return str(d)


@pytest.fixture
def serve_stubbed(monkeypatch):
    """``serve(argv)`` with the launch replaced by a recorder; returns (serve, launched)."""
    import server.launch
    from server.cli import serve

    launched: list = []
    monkeypatch.setattr(server.launch, "launch_server", lambda args: launched.append(args) or 0)
    return serve, launched


def _refused(serve_stubbed, capsys, argv: list[str]) -> str:
    """Run ``ferry serve --device cpu ARGV``; assert the usage error; return its line."""
    serve, launched = serve_stubbed
    with pytest.raises(SystemExit) as ei:
        serve(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert ei.value.code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 2 and lines[0].startswith("ferry serve: error: "), err
    assert lines[1].startswith("usage: ferry serve [options]")
    assert launched == [], "a process was launched"
    return lines[0].removeprefix("ferry serve: error: ")


# ---- LoRA flags and adapters ----------------------------------------------------------------

def test_a_missing_adapter_path_is_refused(serve_stubbed, capsys, tmp_path):
    missing = str(tmp_path / "nope")
    line = _refused(serve_stubbed, capsys, ["--lora-paths", f"a1={missing}"])
    assert line == f"--lora-paths a1={missing}: LoRA adapter path '{missing}' is not a directory"


@pytest.mark.parametrize("make,extra,message", [
    (lambda r: str((r / "empty").mkdir() or r / "empty"), [],
     "no adapter_config.json (not a peft adapter)"),
    (lambda r: _adapter(r, "noweights", weights=False), [],
     "no adapter_model.safetensors or adapter_model.bin"),
    (lambda r: _adapter(r, "r32", r=32), ["--max-lora-rank", "16"],
     "rank 32 (adapter_config.json), above --max-lora-rank 16"),
    (lambda r: _adapter(r, "dora", use_dora=True), [],
     "adapter_config.json: use_dora: DoRA adapters are not supported"),
    (lambda r: _adapter(r, "head", target_modules=["lm_head"]), [],
     "adapters on the embeddings or the LM head are not supported"),
])
def test_an_adapter_that_cannot_be_served_is_refused(make, extra, message, serve_stubbed,
                                                     capsys, tmp_path):
    path = make(tmp_path)
    line = _refused(serve_stubbed, capsys, ["--lora-paths", f"a1={path}", *extra])
    assert line.startswith(f"--lora-paths a1={path}: ") and message in line, line


@pytest.mark.parametrize("argv,flag", [
    (["--max-loras-per-batch", "4"], "--max-loras-per-batch"),
    (["--max-loras-per-batch", "8"], "--max-loras-per-batch"),   # its default, given
    (["--max-lora-rank", "8"], "--max-lora-rank"),
    (["--max-loaded-loras", "2"], "--max-loaded-loras"),
])
def test_lora_flags_without_adapters_are_refused(argv, flag, serve_stubbed, capsys):
    line = _refused(serve_stubbed, capsys, argv)
    assert line.startswith(f"{flag} needs --lora-paths or --enable-lora"), line


def test_servable_adapters_and_lora_flags_launch(serve_stubbed, tmp_path):
    serve, launched = serve_stubbed
    a1, a2 = _adapter(tmp_path, "a1"), _adapter(tmp_path, "a2", r=16)
    assert serve(["--device", "cpu", "--model-path", TINY_LLAMA, "--load-format", "dummy",
                  "--lora-paths", f"one={a1}", a2, "--max-lora-rank", "16",
                  "--max-loras-per-batch", "2"]) == 0
    assert serve(["--device", "cpu", "--model-path", TINY_LLAMA, "--load-format", "dummy",
                  "--enable-lora", "--max-loras-per-batch", "4"]) == 0
    assert len(launched) == 2


# ---- the checkpoint's config ----------------------------------------------------------------

@pytest.mark.parametrize("fields,quant,message", [
    (QWEN3_MOE, "fp8", "--quantization fp8 is not supported for Qwen3MoeForCausalLM, a "
                       "mixture-of-experts model"),
    (QWEN3_MOE, "awq", "--quantization awq is not supported for Qwen3MoeForCausalLM"),
    ({**MIXTRAL, "quantization_config": FP8_CKPT}, None,
     "an FP8 checkpoint (quant_method 'fp8') is not supported for MixtralForCausalLM"),
])
def test_moe_with_a_quantization_is_refused(fields, quant, message, serve_stubbed, capsys,
                                            tmp_path):
    path = _config(tmp_path, "moe", **fields)
    line = _refused(serve_stubbed, capsys, ["--model-path", path, "--load-format", "dummy",
                                            *(["--quantization", quant] if quant else [])])
    assert line.startswith(message), line


def test_an_unsupported_architecture_is_refused(serve_stubbed, capsys, tmp_path):
    path = _config(tmp_path, "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2",
                   bos_token_id=0, eos_token_id=0)  # in the vocabulary: no config warning
    line = _refused(serve_stubbed, capsys, ["--model-path", path, "--load-format", "dummy"])
    assert line.startswith("unsupported model architecture GPT2LMHeadModel; ferry supports "), line
    from engine.models import MODEL_REGISTRY

    assert line.endswith(", ".join(sorted(MODEL_REGISTRY))), line   # every family, sorted


def test_a_model_type_transformers_does_not_know_is_one_line(serve_stubbed, capsys, tmp_path):
    path = _config(tmp_path, "odd", architectures=["OddForCausalLM"], model_type="no-such-type")
    line = _refused(serve_stubbed, capsys, ["--model-path", path, "--load-format", "dummy"])
    assert "no-such-type" in line


def test_an_moe_model_without_quantization_launches(serve_stubbed, tmp_path):
    serve, launched = serve_stubbed
    path = _config(tmp_path, "moe", **QWEN3_MOE)
    assert serve(["--device", "cpu", "--model-path", path, "--load-format", "dummy"]) == 0
    assert len(launched) == 1


@pytest.mark.parametrize("name,family,layers,sliding,nope", [
    ("olmo-2-7b", "Olmo2ForCausalLM", 32, 0, 0),
    ("smollm3-3b", "SmolLM3ForCausalLM", 36, 0, 9),
    ("granite-3.1-8b", "GraniteForCausalLM", 40, 0, 0),
    ("exaone-4.0-32b", "Exaone4ForCausalLM", 64, 48, 16),
])
def test_real_shapes_of_the_dense_families_build_on_meta(name, family, layers, sliding, nope,
                                                          serve_stubbed):
    """engine/configs/ of issue 42's families: the preflight's meta build, and the launch."""
    from engine.args import ServerArgs
    from engine.executor.preflight import build_meta_model

    path = os.path.join(os.path.dirname(engine.__file__), "configs", f"{name}.json")
    model = build_meta_model(ServerArgs(model_path=path, load_format="dummy"), "cpu")
    assert type(model).__name__ == family
    specs = model.layer_specs()
    assert len(specs) == layers
    assert sum(s.attention == "sliding" for s in specs) == sliding
    assert sum(s.rotary is None for s in specs) == nope
    if sliding:   # the window runs: the context is the config's, not capped at the window
        assert model.model_config.context_length == 131072
    serve, launched = serve_stubbed
    assert serve(["--device", "cpu", "--model-path", path, "--load-format", "dummy"]) == 0
    assert len(launched) == 1


def test_real_shape_of_gemma_4_builds_on_meta(serve_stubbed, capsys, tmp_path):
    """engine/configs/gemma-4-e2b.json (issue 42's Gemma 4): 35 layers, 28 sliding, the last
    20 reading earlier layers' K/V (no pool memory: 12 sliding layers of one 256-wide K/V
    head and 3 global of one 512-wide), per-layer inputs; the launch, and the flags the
    family refuses."""
    from engine.args import ServerArgs
    from engine.executor.preflight import build_meta_model
    from engine.kv.pool import kv_bytes_per_token

    path = os.path.join(os.path.dirname(engine.__file__), "configs", "gemma-4-e2b.json")
    model = build_meta_model(ServerArgs(model_path=path, load_format="dummy"), "cpu")
    assert type(model).__name__ == "Gemma4ForCausalLM"
    specs = model.layer_specs()
    assert len(specs) == 35 and sum(s.attention == "sliding" for s in specs) == 28
    assert [s.kv_source_layer for s in specs[15:]] == [13 if (i + 1) % 5 else 14
                                                       for i in range(15, 35)]
    assert kv_bytes_per_token(specs, torch.bfloat16) == (12 * 256 + 3 * 512) * 2 * 2
    assert model.model.embed_tokens_per_layer.weight.shape == (262144, 35 * 256)
    assert model.model.layers[20].mlp.down_proj.weight.shape == (1536, 2 * 6144)
    serve, launched = serve_stubbed
    base = ["--device", "cpu", "--model-path", path, "--load-format", "dummy"]
    assert serve(base) == 0
    assert len(launched) == 1
    launched.clear()
    line = _refused(serve_stubbed, capsys, base + ["--enable-lora"])
    assert "Gemma4ForCausalLM: LoRA adapters are not supported yet" in line, line
    (tmp_path / "config.json").write_text("{}")
    line = _refused(serve_stubbed, capsys, base + ["--speculative-algorithm", "EAGLE",
                                                   "--speculative-draft-model-path",
                                                   str(tmp_path)])
    assert "Gemma4ForCausalLM: EAGLE heads are not supported yet" in line, line


@pytest.mark.parametrize("name,family,q_lora,routing", [
    ("deepseek-v2-lite", "DeepseekV2ForCausalLM", None, "softmax"),
    ("moonlight-16b-a3b", "DeepseekV3ForCausalLM", None, "sigmoid"),
])
def test_real_shapes_of_the_deepseek_families_build_on_meta(name, family, q_lora, routing,
                                                             serve_stubbed, capsys):
    """engine/configs/ of issue 46's families: MLA layers over the latent pool (512 + 64
    values a token), a dense first layer; the launch (with an FP8 latent pool too), and the
    flags MLA refuses."""
    from engine.args import ServerArgs
    from engine.executor.preflight import build_meta_model
    from engine.kv.pool import kv_bytes_per_token

    path = os.path.join(os.path.dirname(engine.__file__), "configs", f"{name}.json")
    model = build_meta_model(ServerArgs(model_path=path, load_format="dummy"), "cpu")
    assert type(model).__name__ == family
    specs = model.layer_specs()
    assert len(specs) == 27 and all(s.attention == "latent" for s in specs)
    assert kv_bytes_per_token(specs, torch.bfloat16) == 27 * 576 * 2
    layers = model.model.layers
    assert layers[0].self_attn.q_lora_rank is q_lora
    assert layers[1].mlp.gate.routing.scoring == routing and not hasattr(layers[0].mlp, "gate")
    serve, launched = serve_stubbed
    base = ["--device", "cpu", "--model-path", path, "--load-format", "dummy"]
    assert serve(base) == 0
    assert serve(base + ["--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert len(launched) == 2
    launched.clear()
    for flags, what in [(["--enable-lora"], "LoRA")]:
        line = _refused(serve_stubbed, capsys, base + flags)
        assert f"{family} (multi-head latent attention) does not support {what}" in line, line
    # MLA splits its 16 heads over the ranks; 3 ranks cannot split them
    assert serve(base + ["--tp-size", "2"]) == 0
    launched.clear()
    line = _refused(serve_stubbed, capsys, base + ["--tp-size", "3"])
    assert "--tp-size 3 does not divide the model's 16 attention heads" in line, line


def test_real_shape_of_deepseek_v3_builds_on_meta():
    """engine/configs/deepseek-v3.json, the shape docs/deployment.md sizes for 8 GPUs: 61
    MLA layers (3 dense), 256 experts in 8 groups, block-FP8 weights kept in e4m3; 671.0B
    parameters, 81.7 GB of routed experts a rank under --ep-size 8, 70,272 latent bytes a
    token in bf16 (35,136 in e4m3)."""
    from engine.args import ServerArgs
    from engine.executor.preflight import build_meta_model
    from engine.kv.pool import kv_bytes_per_token

    path = os.path.join(os.path.dirname(engine.__file__), "configs", "deepseek-v3.json")
    model = build_meta_model(ServerArgs(model_path=path, load_format="dummy"), "cpu")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    specs = model.layer_specs()
    assert len(specs) == 61 and all(s.attention == "latent" for s in specs)
    assert kv_bytes_per_token(specs, torch.bfloat16) == 61 * 576 * 2 == 70272
    assert kv_bytes_per_token(specs, torch.float8_e4m3fn) == 35136
    layers = model.model.layers
    assert not hasattr(layers[2].mlp, "gate")
    routing = layers[3].mlp.gate.routing
    assert (routing.n_group, routing.topk_group, routing.routed_scaling_factor) == (8, 4, 2.5)
    assert layers[3].mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    weights = [p for n, p in model.named_parameters() if not n.endswith("_scale_inv")]
    assert round(sum(p.numel() for p in weights) / 1e9, 1) == 671.0
    routed = sum(p.numel() for n, p in model.named_parameters()
                 if n.endswith(("experts.w13_weight", "experts.w2_weight")))
    assert round(routed / 8 / 1e9, 1) == 81.7      # bytes (e4m3) a rank with --ep-size 8


def test_deployment_doc_deepseek_command_parses():
    """The ``python -m server`` command of docs/deployment.md's DeepSeek-V3 section and its
    commented variants name flags and values that ``ferry serve`` accepts."""
    import re
    import shlex

    from server.cli import serve_parser

    root = os.path.dirname(os.path.dirname(engine.__file__))
    text = open(os.path.join(root, "docs", "deployment.md")).read()
    section = text.split("## DeepSeek-V3 / R1 (671B, block FP8) on 8 GPUs")[1].split("\n## ")[0]
    block = section.split("```bash")[1].split("```")[0]
    command = block.split("\n#")[0].replace("\\\n", " ")
    argv = shlex.split(command)[3:]
    assert argv[:2] == ["--model-path", "/models/DeepSeek-V3"]
    ns = serve_parser().parse_args(argv)
    assert (ns.tp_size, ns.ep_size) == (8, 8)
    extra = re.findall(r"(--[a-z-]+ [\w/.-]+)", block.split("\n#", 1)[1])
    assert extra, block
    serve_parser().parse_args(argv + shlex.split(" ".join(extra)))


def test_real_shape_of_glm_4_5_air_builds_on_meta(serve_stubbed):
    """engine/configs/glm-4.5-air.json (issue 46's GLM-4.5): 46 GQA layers (96 query heads of
    128 over 8 KV heads, half of each head rotated), a dense first layer, then 128 routed
    experts and one shared per layer: 106.9B parameters (the MTP layer not built), 12.8B of
    them active a token besides the embedding; the launch."""
    from engine.args import ServerArgs
    from engine.executor.preflight import build_meta_model
    from engine.kv.pool import kv_bytes_per_token

    path = os.path.join(os.path.dirname(engine.__file__), "configs", "glm-4.5-air.json")
    model = build_meta_model(ServerArgs(model_path=path, load_format="dummy"), "cpu")
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    specs = model.layer_specs()
    assert len(specs) == 46 and all(s.attention == "full" for s in specs)
    assert kv_bytes_per_token(specs, torch.bfloat16) == 46 * 2 * 8 * 128 * 2
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "gate") and layers[0].self_attn.q_norm is None
    assert layers[1].mlp.gate.routing.scoring == "sigmoid"
    assert layers[1].mlp.experts.w13_weight.shape == (128, 2 * 1408, 4096)
    assert model.model.rotary_emb.rotary_dim == 64
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - routed + routed * 8 // 128 - 151552 * 4096
    assert round(total / 1e9, 1) == 106.9 and round(active / 1e9, 1) == 12.8
    shapes = model.hf_weight_shapes()
    assert shapes["model.layers.1.mlp.gate.e_score_correction_bias"] == (128,)
    assert shapes["model.layers.45.mlp.shared_experts.down_proj.weight"] == (4096, 1408)
    serve, launched = serve_stubbed
    assert serve(["--device", "cpu", "--model-path", path, "--load-format", "dummy"]) == 0
    assert len(launched) == 1


def test_real_shape_of_qwen2_5_vl_builds_on_meta(serve_stubbed, capsys):
    """engine/configs/qwen2.5-vl-7b-instruct.json (issue 48): the language model with
    M-RoPE (the legacy ``mrope`` rope type), the 32-block vision tower; the launch (TP=2
    too), and the flag image models refuse."""
    from engine.args import ServerArgs
    from engine.executor.preflight import build_meta_model

    path = os.path.join(os.path.dirname(engine.__file__), "configs",
                        "qwen2.5-vl-7b-instruct.json")
    model = build_meta_model(ServerArgs(model_path=path, load_format="dummy"), "cpu")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert len(model.layer_specs()) == 28 and len(model.visual.blocks) == 32
    assert model.model.rotary_emb.axis_mask.shape == (3, 1, 128)
    shapes = model.hf_weight_shapes()
    assert shapes["visual.patch_embed.proj.weight"] == (1280, 3, 2, 14, 14)
    assert shapes["visual.merger.mlp.2.weight"] == (3584, 5120)
    serve, launched = serve_stubbed
    base = ["--device", "cpu", "--model-path", path, "--load-format", "dummy"]
    assert serve(base) == 0
    assert len(launched) == 1
    launched.clear()
    assert serve(base + ["--tp-size", "2"]) == 0   # the tower replicated on every rank
    assert len(launched) == 1
    launched.clear()
    assert serve(base + ["--speculative-algorithm", "NGRAM"]) == 0  # verify at M-RoPE positions
    assert len(launched) == 1
    launched.clear()
    line = _refused(serve_stubbed, capsys, base + ["--speculative-algorithm", "EAGLE",
                                                   "--speculative-draft-model-path", path])
    assert ("Qwen2_5_VLForConditionalGeneration (image input) does not support "
            "--speculative-algorithm EAGLE yet (NGRAM runs)") in line, line


def test_real_shape_of_qwen3_vl_builds_on_meta(serve_stubbed):
    """engine/configs/qwen3-vl-8b-instruct.json: a Qwen3 language model (q/k norms) with
    interleaved M-RoPE, a 27-block tower with three DeepStack levels; the launch."""
    from engine.args import ServerArgs
    from engine.executor.preflight import build_meta_model

    path = os.path.join(os.path.dirname(engine.__file__), "configs",
                        "qwen3-vl-8b-instruct.json")
    model = build_meta_model(ServerArgs(model_path=path, load_format="dummy"), "cpu")
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert len(model.layer_specs()) == 36 and len(model.visual.blocks) == 27
    assert len(model.visual.deepstack_merger_list) == 3
    shapes = model.hf_weight_shapes()
    assert shapes["visual.pos_embed.weight"] == (2304, 1152)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    serve, launched = serve_stubbed
    assert serve(["--device", "cpu", "--model-path", path, "--load-format", "dummy"]) == 0
    assert len(launched) == 1


@pytest.mark.parametrize("argv,message", [
    (["--model-path", TINY_LLAMA, "--load-format", "dummy", "--tp-size", "3"], "3"),
    (["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/no/draft"],
     "--speculative-draft-model-path /no/draft: no such file or directory"),
    (["--model-path", "/no/such/model.gguf"], "model path '/no/such/model.gguf' does not exist"),
])
def test_shape_draft_and_gguf_paths_stay_refused(argv, message, serve_stubbed, capsys):
    line = _refused(serve_stubbed, capsys, argv)
    assert message in line, line


# ---- XPU: one tensor over the per-allocation limit --------------------------------------------

def test_xpu_tensor_over_the_allocation_limit_is_refused(monkeypatch, tmp_path):
    """An embedding (and LM head) of 3M x 1024 bf16 (5.7 GiB) on XPU: refused with the variable that relaxes
    the limit; with it set, or split over 2 ranks, it passes."""
    from engine import device as dev
    from engine.args import ServerArgs
    from engine.executor import preflight

    path = _config(tmp_path, "bighead", architectures=["LlamaForCausalLM"], model_type="llama",
                   intermediate_size=128, hidden_size=1024, num_attention_heads=8,
                   num_key_value_heads=8, vocab_size=3_000_000)
    monkeypatch.setattr(dev, "resolve_device", lambda name="auto": "xpu")
    monkeypatch.delenv(preflight.XPU_RELAX_ENV, raising=False)
    args = ServerArgs(model_path=path, load_format="dummy")
    with pytest.raises(ValueError) as ei:
        preflight.check_start_up(args)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith("model.embed_tokens.weight is 5.7 GiB, above the 4 GiB that an Intel "
                          "Arc GPU "
                          "allocates at once: set UR_L0_ENABLE_RELAXED_ALLOCATION_LIMITS=1"), msg
    preflight.check_start_up(args.replace(tp_size=2))  # 2.9 GiB per rank
    monkeypatch.setenv(preflight.XPU_RELAX_ENV, "1")
    preflight.check_start_up(args)


def test_the_allocation_limit_is_an_xpu_check_only(monkeypatch, tmp_path):
    from engine.args import ServerArgs
    from engine.executor import preflight

    model = torch.nn.Linear(1, 1, device="meta")
    with torch.device("meta"):
        model.big = torch.nn.Parameter(torch.empty(5 << 30, dtype=torch.uint8),
                                       requires_grad=False)
    monkeypatch.delenv(preflight.XPU_RELAX_ENV, raising=False)
    with pytest.raises(ValueError, match=r"^big is 5\.0 GiB"):
        preflight.check_xpu_allocations(model)
    monkeypatch.setattr(preflight, "build_meta_model", lambda args, device_type: model)
    preflight.check_start_up(ServerArgs(device="cpu"))  # the CPU has no such limit


# ---- pooling models -------------------------------------------------------------------------

QWEN3 = dict(model_type="qwen3", intermediate_size=96, head_dim=16,
             id2label={"0": "LABEL_0"})  # one label (transformers' default is two)


@pytest.mark.parametrize("arch,extra", [
    ("Qwen3ForSequenceClassification", {}),   # a cross-encoder, detected
    ("Qwen3Model", {}),                       # a bare stack: an embedder, detected
    ("Qwen3ForCausalLM", {"--is-embedding": None}),
])
def test_pooling_checkpoints_launch(arch, extra, serve_stubbed, tmp_path):
    serve, launched = serve_stubbed
    path = _config(tmp_path, "pool", architectures=[arch], **QWEN3)
    assert serve(["--device", "cpu", "--model-path", path, "--load-format", "dummy",
                  *extra]) == 0
    assert len(launched) == 1


@pytest.mark.parametrize("arch,fields,argv,message", [
    ("Qwen3ForSequenceClassification", {}, ["--yes-no-reranker"],
     "--yes-no-reranker reads the LM head of a causal LM"),
    ("Qwen3ForSequenceClassification", {"id2label": {"0": "a", "1": "b", "2": "c"}}, [],
     "Qwen3ForSequenceClassification with 3 labels"),
    ("GPT2Model", {"model_type": "gpt2"}, [], "unsupported model architecture GPT2Model"),
])
def test_pooling_checkpoints_refused(arch, fields, argv, message, serve_stubbed, capsys,
                                     tmp_path):
    path = _config(tmp_path, "pool", **{**QWEN3, "architectures": [arch], **fields})
    line = _refused(serve_stubbed, capsys, ["--model-path", path, "--load-format", "dummy",
                                            *argv])
    assert line.startswith(message), line
