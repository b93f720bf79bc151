"""Gemma 2, Gemma 3 (text), Gemma 4 (text, its MoE variant) and multimodal Gemma 3 and 4
checkpoints' language models served by ferry vs HF transformers.

Each case is a tiny random HF model (hidden 64, head_dim 16, sliding windows of 8 tokens:
smaller than the 13- and 40-token prompts; Gemma 2 with attention and final soft-caps small
enough to bite; Gemma 3 with layers 2 and 5 global, a local rope base of 100 and a linearly
scaled global one) saved with ``save_pretrained`` and loaded by the offline ``LLM``
(float32, CPU; the vision tower of the multimodal checkpoint is skipped). ferry's greedy
tokens must equal HF ``generate``'s over 12 steps and the chosen tokens' log-probabilities
agree within 1e-3: in a batch of different lengths, alone (a prefix-cache miss), with the
prefix cache hit, and across chunked-prefill boundaries (``chunked_prefill_size=16``).
Tensor parallelism TP=2 vs TP=1 (gloo) runs on the Gemma 3 and the Gemma 4 MoE checkpoints.
Gemma 4's cases (text with per-layer inputs, K = V global layers and KV sharing; its MoE
variant; a multimodal checkpoint's language model) also check that the KV-sharing layers
read their source's pool buffers and hold none of their own.
"""

from __future__ import annotations

import pytest
import torch
from gemma_helpers import CASES, save_tiny
from parity_helpers import (
    NEW_TOKENS,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    SP,
    assert_batch_and_alone_match_hf,
    assert_matches_hf,
    assert_prefix_hits_match_hf,
    case_fixtures,
    hf_greedy,
    parity_llm,
    seeded_prompts,
)

from engine.llm import LLM
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow



def _prompts() -> list[list[int]]:
    return seeded_prompts(high=250)


checkpoint, served = case_fixtures(CASES, save_tiny, _prompts())


def test_batch_and_alone_match_hf(served):
    case, hf, llm, ref = served
    assert type(llm.runner.model).__name__ == type(hf).__name__
    windows = {s.sliding_window for s in llm.runner.model.layer_specs()}
    assert 8 in windows and None in windows        # local and global layers
    assert_batch_and_alone_match_hf(llm, _prompts(), ref, case)


def test_gemma4_kv_sharing_holds_no_kv_memory(served):
    """Gemma 4: the KV-sharing layers read their source layer's buffers (the same tensors)
    and the pool holds memory for the other layers only, at each layer's own shape."""
    case, hf, llm, ref = served
    if not case.startswith("gemma4"):
        pytest.skip("KV sharing is Gemma 4's")
    specs = llm.runner.model.layer_specs()
    pool = llm.runner.kv_pool
    text = getattr(hf.config, "text_config", hf.config)
    shared = [i for i, s in enumerate(specs) if s.kv_source_layer is not None]
    assert len(shared) == text.num_kv_shared_layers
    for i in shared:
        src = specs[i].kv_source_layer
        assert pool.k_buffers[i] is pool.k_buffers[src] and specs[src].kv_source_layer is None
        assert specs[i].attention == specs[src].attention
    owners = {id(b): b for b in pool.k_buffers + pool.v_buffers}
    assert len(owners) == 2 * (len(specs) - len(shared))
    for i, spec in enumerate(specs):     # each at its layer's shape; global layers 32 wide
        assert tuple(pool.k_buffers[i].shape[1:]) == (spec.num_kv_heads, spec.head_dim)
        assert spec.head_dim == (16 if spec.attention == "sliding" else 32)


def test_prefix_cache_hit_matches_hf(served):
    """The long prompt again (a hit past the window), and one that shares its first 32
    tokens (a partial hit); both must still give HF's tokens.

    The windowed KV pool gives a finished request's window pages back once its decode moved
    past them, so a repeated prompt misses there (engine/kv/windowed.py; its hits are
    tested in tests/engine/test_windowed_kv.py): this checks the hits of one shared pool."""
    case, hf, llm_windowed, ref = served
    path = llm_windowed.args.model_path
    with parity_llm(path, swa_full_tokens_ratio=0) as llm:
        assert_prefix_hits_match_hf(llm, hf, _prompts()[2], ref[2], case)


def test_chunked_prefill_matches_hf(checkpoint):
    """Prefill chunks of 16 tokens: the 40-token prompt crosses two chunk boundaries (with
    windows of 8, a chunk's queries see keys of the previous chunk only partly)."""
    case, _, path, ref = checkpoint
    if case == "gemma3_mm":
        pytest.skip("the same language model as gemma3")
    with parity_llm(path, chunked_prefill_size=16) as llm:
        outs = llm.generate(_prompts(), SP)
        alone = llm.generate([_prompts()[2]], SP)[0]
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert_matches_hf(out, r, f"{case} prompt {i} chunked in a batch")
    assert_matches_hf(alone, ref[2], f"{case} long prompt chunked")


# ---- tensor parallelism (gloo, 2 ranks on the CPU) ------------------------------------------


def _run_tp(path: str, tp: int):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    # one shared KV pool (the windowed pool runs with TP=1 only, and gives a finished
    # request's window back, so PROMPT_B's prefix would miss there)
    with LLM(path, tp_size=tp, cpu_threads=1, dtype="float32", device="cpu", seed=3,
             swa_full_tokens_ratio=0) as llm:
        first = llm.generate([PROMPT_A, PROMPT_C], sp)
        second = llm.generate([PROMPT_B], sp)
    assert second[0].num_cached_tokens >= 192
    outs = first + second
    lps = [lp for o in outs for tok_lp, top in o.logprobs
           for lp in [tok_lp, *(v for _, v in top)]]
    return [o.token_ids for o in outs], lps


def _assert_tp_matches(path: str) -> None:
    ref_toks, ref_lps = _run_tp(path, 1)
    toks, lps = _run_tp(path, 2)
    assert toks == ref_toks
    worst = max(abs(a - b) for a, b in zip(lps, ref_lps))
    assert worst < 1e-4, f"largest log-prob difference TP=2 vs TP=1: {worst:.2e}"


def test_tp2_matches_tp1_gemma3(tmp_path):
    save_tiny("gemma3", tmp_path)
    _assert_tp_matches(str(tmp_path))


def test_tp2_matches_tp1_gemma4_moe(tmp_path):
    """Gemma 4 (the MoE checkpoint: KV-sharing layers projecting q only, one global K/V
    head replicated on both ranks, per-layer inputs, experts split by width) at TP=2."""
    save_tiny("gemma4_moe", tmp_path)
    _assert_tp_matches(str(tmp_path))


# ---- speculative decoding (the target's greedy tokens whatever the drafts) ----------------


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE", "EAGLE3"])
def test_speculative_decoding_keeps_hf_tokens_gemma2(algo, tmp_path):
    """NGRAM drafts, and random EAGLE / EAGLE-3 heads reading the Gemma 2 target's hidden
    states (the decoder's capture hook: final normed states, or the inputs of layers 2, 2
    and 1): every verified token must still be HF's."""
    from test_speculative_models import save_head

    hf = save_tiny("gemma2", tmp_path / "target")
    kw = {"speculative_num_draft_tokens": 3}
    if algo != "NGRAM":
        save_head(tmp_path / "head", algo == "EAGLE3", seed=5)
        kw = {"speculative_draft_model_path": str(tmp_path / "head"),
              "speculative_num_steps": 3}
    prompts = _prompts()
    with parity_llm(tmp_path / "target", speculative_algorithm=algo, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                    ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p)[0], f"{algo}: {p}"


# ---- LoRA (the projections have Llama's names) ----------------------------------------------


def test_lora_on_every_projection_matches_peft_gemma2(tmp_path):
    """A seeded peft adapter on all seven projections of the Gemma 2 checkpoint: ferry's
    greedy tokens with it equal transformers + peft's (and differ from the base's)."""
    from lora_helpers import ALL_MODULES, greedy_reference
    from peft import LoraConfig, get_peft_model

    base = save_tiny("gemma2", tmp_path / "base")
    pm = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=ALL_MODULES,
                                         init_lora_weights=False, lora_dropout=0.0)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    pm.save_pretrained(tmp_path / "a1")
    prompts = _prompts()[1:]
    refs = [greedy_reference(pm, p, NEW_TOKENS) for p in prompts]
    with pm.disable_adapter():
        assert [greedy_reference(pm, p, NEW_TOKENS)[0] for p in prompts] != \
            [r[0] for r in refs]
    with parity_llm(tmp_path / "base", lora_paths=[f"a1={tmp_path / 'a1'}"]) as llm:
        outs = llm.generate(prompts, SP, lora="a1")
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_matches_hf(out, ref, f"gemma2 + LoRA prompt {i}")


# ---- the piecewise split (pieces called directly on the CPU; graphs on GPUs) ----------------


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_piecewise_pieces_match_the_forward(case, tmp_path):
    """The forward cut at its attention calls (sandwich norms across the cut, a rope per
    layer type, the final soft-cap in ``compute_logits``) gives the plain forward's logits
    for a prefill and for a mixed prefill + decode step."""
    from test_piecewise import _compare

    from engine.args import ServerArgs
    from engine.executor.model_runner import ModelRunner
    from engine.executor.piecewise_runner import PiecewiseRunner
    from engine.forward_batch import ForwardMode
    from engine.scheduler.request import Req
    from engine.scheduler.scheduler import Scheduler

    save_tiny(case, tmp_path)
    args = ServerArgs(model_path=str(tmp_path), device="cpu", dtype="float32",
                      max_total_tokens=4096, chunked_prefill_size=64, max_running_requests=8)
    runner = ModelRunner(args)
    sched = Scheduler(args, runner)
    pw = PiecewiseRunner(runner, max_tokens=96, use_graphs=False)
    sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    a, b, c = _prompts()
    sched.add_request(Req("a", a + b, sp))
    sched.add_request(Req("b", c, sp))
    batch = sched.get_next_batch()
    assert batch.mode == ForwardMode.EXTEND
    _compare(runner, pw, batch)
    sched.inflight = sched._launch(batch)
    sched._drain()
    sched.add_request(Req("c", c[:30], sp))
    batch = sched.get_next_batch()
    assert batch.num_decodes == 2
    _compare(runner, pw, batch)


# ---- GGUF (transformers' gemma2/gemma3 mapping; llama.cpp stores the norms as 1 + w) -------


def _write_gguf(hf, arch: str, path: str) -> None:
    """``hf``'s tensors as an F32 GGUF file of llama.cpp's layout (its tensor names, norm
    weights stored as ``1 + w``) with the config keys transformers reads."""
    import numpy as np
    from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map

    cfg = hf.config
    w = GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    arch_enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    for name, t in hf.state_dict().items():
        base, _, suffix = name.rpartition(".")
        gname = table.get_name(base)
        if gname is not None:       # (a tied lm_head has none)
            a = t.float().numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
            w.add_tensor(f"{gname}.{suffix}", a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_gguf_weights_load_like_the_safetensors(case, tmp_path):
    """Every weight equal (names mapped, norms back to ``w``). The config is transformers'
    from the GGUF keys: what they lack (soft-caps, ``query_pre_attn_scalar``, Gemma 3's
    layer pattern and rope scaling) takes the config class's defaults, so only Gemma 2's
    alternating layers are compared."""
    pytest.importorskip("gguf")
    from engine.loader.loader import load_model

    hf = save_tiny(case, tmp_path)
    _write_gguf(hf, case, str(tmp_path / "tiny.gguf"))
    ref, _ = load_model(str(tmp_path), "safetensors", dtype=torch.float32, device="cpu",
                        progress=False)
    got, _ = load_model(str(tmp_path / "tiny.gguf"), "auto", dtype=torch.float32,
                        device="cpu", progress=False)
    assert type(got) is type(ref)
    if case == "gemma2":
        assert [s.sliding_window for s in got.layer_specs()] == [8, None] * 2
    want, have = ref.state_dict(), got.state_dict()
    assert want.keys() == have.keys()
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=0, atol=1e-6, msg=k)
