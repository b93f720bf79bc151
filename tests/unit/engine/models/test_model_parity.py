"""Ferry's Llama/Qwen2/Qwen3/Mistral vs HF transformers on tiny random models (CPU, fp32).

Each HF model is randomly initialised (seeded, every parameter including norms and biases),
saved with ``save_pretrained`` (safetensors), loaded through ferry's loader, and run over the
paged KV cache with hand-built ``ForwardBatch``es. HF runs each full sequence alone (eager
attention, no padding); logits must agree to a relative error (||a - b|| / ||b||) < 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from fb_helpers import KVState

from engine.loader.loader import load_model

TOL = 1e-4


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "attn_implementation": "eager"}
    return {
        # llama3 rope scaling, q/k/v/o bias, untied head, head_dim 16
        "llama": LlamaConfig(**common, attention_bias=True, tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "rope_theta": 5000.0,
                                           "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 32}),
        # q/k/v bias, tied embeddings
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True, rope_theta=10000.0),
        # q_norm/k_norm, head_dim 32 != hidden / heads
        "qwen3": Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
        "mistral": MistralConfig(**common, sliding_window=None, tie_word_embeddings=False),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def models(request, tmp_path_factory):
    """(hf_model, ferry_model, config) for one architecture."""
    from transformers import AutoModelForCausalLM

    cfg = _configs()[request.param]
    torch.manual_seed(1234)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    ours, config = load_model(str(d), load_format="auto", dtype="float32", device="cpu",
                              progress=False)
    expected_cls = cfg.architectures[0] if cfg.architectures else None
    assert expected_cls is None or type(ours).__name__ == expected_cls
    return hf, ours, config


def _hf_logits(hf, seqs: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(input_ids=torch.tensor([s])).logits[0].float() for s in seqs]


def _seqs(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def test_ragged_prefill_then_batched_decode(models):
    hf, ours, config = models
    prompt_lens, n_decode = [5, 11, 17], 4
    full = _seqs(config.vocab_size, [n + n_decode for n in prompt_lens], seed=7)
    ref = _hf_logits(hf, full)
    kv = KVState(config)

    # (a) one extend step over the three ragged prompts, logits of every token
    ids, pos, fb = kv.extend([(i, s[:n]) for i, (s, n) in enumerate(zip(full, prompt_lens))])
    with torch.no_grad():
        logits = ours(ids, pos, fb)
    assert logits.dtype == torch.float32 and logits.shape == (sum(prompt_lens), config.vocab_size)
    want = torch.cat([r[:n] for r, n in zip(ref, prompt_lens)])
    assert _rel(logits, want) < TOL

    # (b) batched decode, one token per request per step (teacher-forced from ``full``)
    for step in range(n_decode):
        ids, pos, fb = kv.decode([(i, s[n + step]) for i, (s, n) in
                                  enumerate(zip(full, prompt_lens))])
        with torch.no_grad():
            logits = ours(ids, pos, fb)
        assert logits.shape == (3, config.vocab_size)
        want = torch.stack([r[n + step] for r, n in zip(ref, prompt_lens)])
        assert _rel(logits, want) < TOL, f"decode step {step}"


def test_extend_with_cached_prefix(models):
    """Chunked prefill: a second extend step over prefixes already in the paged KV cache."""
    hf, ours, config = models
    full = _seqs(config.vocab_size, [12, 9, 15, 6], seed=11)
    ref = _hf_logits(hf, full)
    kv = KVState(config, page_size=4)
    first = {0: 5, 1: 9, 2: 7}                 # request 3 only arrives in the second step
    ids, pos, fb = kv.extend([(r, full[r][:k]) for r, k in first.items()], all_logits=False)
    with torch.no_grad():
        logits = ours(ids, pos, fb)
    want = torch.stack([ref[r][k - 1] for r, k in first.items()])
    assert logits.shape == (3, config.vocab_size) and _rel(logits, want) < TOL

    # requests 0 and 2 continue after their cached prefix, 1 is done, 3 is new (prefix 0)
    second = [(0, 5), (2, 7), (3, 0)]
    ids, pos, fb = kv.extend([(r, full[r][k:]) for r, k in second])
    assert fb.extend_prefix_lens.tolist() == [5, 7, 0]
    with torch.no_grad():
        logits = ours(ids, pos, fb)
    want = torch.cat([ref[r][k:] for r, k in second])
    assert _rel(logits, want) < TOL
