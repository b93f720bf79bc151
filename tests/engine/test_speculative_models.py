"""Speculative decoding with a model proposer (issue 26): STANDALONE (a draft model with the
target's vocabulary) and EAGLE / EAGLE-3 heads, on tiny seeded random Llama checkpoints in
float32 on the CPU. Greedy output must be the target's own (no speculation); a target that
drafts for itself has every draft accepted; the draft KV is released with the requests."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.params import SamplingParams

VOCAB = 256


def _llama_config(layers: int, hidden: int = 64, seed_heads: int = 4):
    import transformers as T

    return T.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_attention_heads=seed_heads, num_key_value_heads=2,
                         num_hidden_layers=layers, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False, attn_implementation="eager")


def save_llama(path, layers: int, seed: int, hidden: int = 64):
    """A seeded random HF Llama (fp32) saved with a 256-token character tokenizer."""
    from moe_helpers import save_char_tokenizer
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(_llama_config(layers, hidden)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    hf.save_pretrained(path)
    save_char_tokenizer(path)
    return hf


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_models")
    target, draft = root / "target", root / "draft"
    hf = save_llama(target, layers=4, seed=3)
    save_llama(draft, layers=1, seed=11)
    return {"target": str(target), "draft": str(draft), "hf": hf, "root": root}


KW = dict(device="cpu", max_total_tokens=2048, chunked_prefill_size=16)
PROMPTS = [[5, 9, 14, 3, 77, 120, 31], list(range(40, 80)), [200, 201, 7]]


@pytest.fixture(scope="module")
def baseline(ckpts):
    from engine import LLM

    llm = LLM(ckpts["target"], **KW)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, sp)]


def _run(llm, sp=None):
    sp = sp or SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, sp)]


def _check_released(llm):
    sched = llm.scheduler
    sched.kv.check([])
    prop = sched.spec.proposer
    prop.sweep()
    assert prop.seqs == {} and prop.used_tokens() == 0


def test_standalone_self_draft_accepts_every_draft(ckpts, baseline):
    from engine import LLM

    k = 3
    llm = LLM(ckpts["target"], speculative_algorithm="STANDALONE",
              speculative_draft_model_path=ckpts["target"], speculative_num_steps=k, **KW)
    llm.scheduler.check_kv = True
    assert _run(llm) == baseline
    st = llm.scheduler.stats
    assert st["spec_verify_reqs"] > 0
    lengths = st["spec_accept_lengths"]
    # every verify emits k + 1 tokens, except near max_tokens where fewer were proposed
    full = lengths[k]
    assert st["spec_accepted_tokens"] == st["spec_proposed_tokens"]
    assert full >= st["spec_verify_reqs"] - len(PROMPTS)
    _check_released(llm)


def test_standalone_other_draft_keeps_greedy_output(ckpts, baseline):
    from engine import LLM

    llm = LLM(ckpts["target"], speculative_algorithm="STANDALONE",
              speculative_draft_model_path=ckpts["draft"], speculative_num_steps=4,
              page_size=4, **KW)
    llm.scheduler.check_kv = True
    out = _run(llm)
    assert out == baseline
    st = llm.scheduler.stats
    assert st["spec_proposed_tokens"] > st["spec_accepted_tokens"]  # a poor draft: rejections
    # n > 1 (the same prompt twice), a max_tokens shorter than the chain, a radix-cache hit
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    two = llm.generate([PROMPTS[1], PROMPTS[1]], sp)
    assert [o.token_ids for o in two] == [baseline[1][:2]] * 2
    _check_released(llm)


def test_standalone_vocabulary_mismatch_fails_at_start(ckpts, tmp_path):
    import transformers as T

    from engine import LLM

    cfg = _llama_config(1)
    cfg.vocab_size = VOCAB + 64
    T.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--speculative-draft-model-path .* vocabulary has "
                                         "320 ids, the target's 256"):
        LLM(ckpts["target"], speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(tmp_path), **KW)
