"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention over the latent pool, DeepSeek's
MoE) served by ferry vs HF transformers.

Each case is a tiny random HF checkpoint (:mod:`deepseek_helpers`: a dense first layer, 8
routed experts in 4 groups, a shared expert; q_lora on and off; V2's softmax routing with and
without groups, V3's sigmoid routing with the correction bias, rope interleaved and not)
loaded by the offline ``LLM`` (float32, CPU). ferry's greedy tokens must equal HF
``generate``'s and the chosen tokens' log-probabilities agree within 1e-3 over 12 steps: in
a batch of different lengths, alone (prefix cache missed), with the prefix cache hit (whole
and partial), and with prompts prefilled in chunks of 16 tokens.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_helpers import CASES, save_tiny

from engine.kv.pool import LatentKVPool
from engine.layer_spec import AttentionKind
from engine.layers.mla import MLAttention
from engine.layers.moe_grouped import GroupedMoeBlock
from engine.llm import LLM
from engine.models.blocks import GatedMLP
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
LOGPROB_TOL = 1e-3
SP = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 13, 40)]


def _hf_generate(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, toks)]
    return toks, lps


def _assert_matches(out, ref, what: str) -> None:
    toks, lps = ref
    assert out.token_ids == toks, f"{what}: ferry {out.token_ids} != HF {toks}"
    worst = max(abs(entry[0] - b) for entry, b in zip(out.logprobs, lps))
    assert worst < LOGPROB_TOL, f"{what}: log-prob differs from HF by {worst:.2e}"


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request, tmp_path_factory):
    """(case, HF model, checkpoint dir, HF reference per prompt), built once per case."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    return request.param, hf, path, [_hf_generate(hf, p) for p in _prompts()]


@pytest.fixture(scope="module")
def served(checkpoint):
    case, hf, path, ref = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=4096)
    yield case, hf, llm, ref
    llm.shutdown()


def test_layers_are_mla_over_the_latent_pool(served):
    case, hf, llm, _ = served
    model = llm.runner.model
    assert type(model).__name__ == type(hf).__name__
    assert all(s.attention == AttentionKind.LATENT for s in model.layer_specs())
    assert isinstance(llm.runner.kv_pool, LatentKVPool)
    layers = model.model.layers
    assert all(isinstance(layer.self_attn, MLAttention) for layer in layers)
    assert isinstance(layers[0].mlp, GatedMLP)                       # first_k_dense_replace
    assert all(isinstance(layer.mlp, GroupedMoeBlock) for layer in layers[1:])
    assert (layers[0].self_attn.q_lora_rank is None) == (case in ("v2", "v3_noq"))


def test_batch_and_alone_match_hf(served):
    case, _, llm, ref = served
    prompts = _prompts()
    batch = llm.generate(prompts, SP)
    for i, (out, r) in enumerate(zip(batch, ref)):
        _assert_matches(out, r, f"{case} prompt {i} in a batch")
    for i, p in enumerate(prompts):
        assert llm.scheduler.flush_cache()
        alone = llm.generate([p], SP)[0]
        assert alone.num_cached_tokens == 0          # a prefix-cache miss
        _assert_matches(alone, ref[i], f"{case} prompt {i} alone")
        assert alone.token_ids == batch[i].token_ids


def test_prefix_cache_hit_matches_hf(served):
    """The long prompt again (a hit), and one sharing its first 32 tokens (a partial hit)."""
    case, hf, llm, ref = served
    long = _prompts()[2]
    assert llm.scheduler.flush_cache()
    assert llm.generate([long], SP)[0].num_cached_tokens == 0
    again = llm.generate([long], SP)[0]
    assert again.num_cached_tokens is not None and again.num_cached_tokens >= 32
    _assert_matches(again, ref[2], f"{case} cached prompt")
    shared = long[:32] + [9, 8, 7, 6, 5]
    out = llm.generate([shared], SP)[0]
    assert out.num_cached_tokens >= 24
    _assert_matches(out, _hf_generate(hf, shared), f"{case} shared prefix")


def test_chunked_prefill_matches_hf(checkpoint):
    """Prompts of 40 and 45 tokens prefilled 16 tokens a step, in a batch (mixed steps)."""
    case, hf, path, ref = checkpoint
    longer = [(5 * i + 11) % 250 + 3 for i in range(45)]
    with LLM(str(path), dtype="float32", device="cpu", cpu_threads=1, max_total_tokens=4096,
             chunked_prefill_size=16) as llm:
        outs = llm.generate([_prompts()[2], longer], SP)
    _assert_matches(outs[0], ref[2], f"{case} chunked prompt")
    _assert_matches(outs[1], _hf_generate(hf, longer), f"{case} chunked 45-token prompt")
