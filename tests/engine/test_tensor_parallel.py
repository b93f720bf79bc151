"""Tensor parallelism on the CPU (gloo): TP=2 must give TP=1's tokens and log-probabilities.

Each case is a small dummy model (seeded weights drawn at the full HF shapes, so both TP
sizes load the same model) run through the offline ``LLM`` with the scheduler's real paths:
a chunked prefill (a prompt longer than the CPU chunk), a cached prefix (the second prompt
extends the first, so rank 0's ``req_to_token`` writes must reach the worker), mixed
prefill+decode steps and greedy decoding. The reference is the TP=1 run of the same model.
"""

from __future__ import annotations

import json

import pytest
from parity_helpers import floats_in

from engine.distributed import check_tp_shape
from engine.llm import LLM
from engine.sampling.params import SamplingParams

BASE = {"bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64,
        "intermediate_size": 128, "max_position_embeddings": 2048, "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0}

CASES = {
    # KV heads split over the ranks; a vocabulary that does not divide by 2 (padded shard);
    # an untied LM head
    "llama-gqa": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1001,
                      tie_word_embeddings=False),
    # one KV head replicated on both ranks
    "llama-mqa-replicated": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                                 num_attention_heads=4, num_key_value_heads=1,
                                 vocab_size=1000, tie_word_embeddings=True),
    # q/k/v bias
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  tie_word_embeddings=False),
    # per-head q/k norms, head_dim (32) unlike hidden / heads (16)
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
                  tie_word_embeddings=True),
}

PROMPT_A = [(7 * i + 3) % 997 + 1 for i in range(300)]   # > the CPU prefill chunk (256)
PROMPT_B = PROMPT_A[:200] + [5, 6, 7, 8, 9, 10]          # shares a 200-token prefix
PROMPT_C = [11, 12, 13]


def _run(path: str, tp: int):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5,
                        prompt_logprobs=3)
    with LLM(path, load_format="dummy", tp_size=tp, cpu_threads=1, seed=3) as llm:
        first = llm.generate([PROMPT_A, PROMPT_C], sp)
        # hits the cached prefix of PROMPT_A (prompt logprobs would recompute the prompt)
        second = llm.generate([PROMPT_B], SamplingParams(max_tokens=6, temperature=0,
                                                         ignore_eos=True, logprobs=5))
    assert second[0].num_cached_tokens >= 192
    return first + second



def _flat(outs):
    """(token ids of each output, every log-probability in the outputs, in order)."""
    return ([list(o.token_ids) for o in outs],
            [f for o in outs for f in floats_in(o.logprobs) + floats_in(o.prompt_logprobs)])


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(case, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **CASES[case]}))
    ref = _run(str(tmp_path), 1)
    got = _run(str(tmp_path), 2)
    ref_toks, ref_lps = _flat(ref)
    got_toks, got_lps = _flat(got)
    assert got_toks == ref_toks
    # 3 outputs x 6 tokens x 6 values, plus (299 + 2) prompt positions x 4
    assert len(got_lps) == len(ref_lps) == 3 * 6 * 6 + 301 * 4
    worst = max(abs(a - b) for a, b in zip(got_lps, ref_lps))
    assert worst < 1e-4, f"largest log-prob difference TP=2 vs TP=1: {worst:.2e}"


def test_head_counts_that_do_not_split_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--tp-size 2 does not divide the model's 9 attention"):
        check_tp_shape(9, 3, 2)
    with pytest.raises(ValueError, match="--tp-size 4 does not divide the model's 6 KV heads"):
        check_tp_shape(8, 6, 4)
    with pytest.raises(ValueError, match="3 KV heads cannot be replicated evenly over "
                                         "--tp-size 4"):
        check_tp_shape(12, 3, 4)
    check_tp_shape(8, 2, 4)   # splits
    check_tp_shape(8, 1, 4)   # replicated
    # the embedded SmolLM2 has 9 query heads: refused before any worker starts
    with pytest.raises(ValueError, match="9 attention heads"):
        LLM(None, tp_size=2, cpu_threads=1)
