"""The HF-parity scaffolding of the model-family tests in tests/engine: seeded prompts, HF
transformers' greedy reference, the comparison of ferry's output with it, the offline ``LLM``
those tests serve a tiny checkpoint with (float32, CPU, one thread), and the checks of a
batch, of prompts alone and of prefix-cache hits that several families run the same way.

A test module imports these by name (pytest puts tests/engine on ``sys.path`` for its own
modules): ``from parity_helpers import SP, assert_matches_hf, hf_greedy, seeded_prompts``.
"""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling.params import SamplingParams

#: greedy steps compared with HF, and the largest |log-prob difference| allowed per step
NEW_TOKENS = 12
LOGPROB_TOL = 1e-3
#: greedy, ``NEW_TOKENS`` steps whatever the EOS, the chosen token's log-prob returned
SP = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
#: the ``LLM`` arguments of a parity run (``parity_llm``'s keywords override them)
CPU_FP32 = {"dtype": "float32", "device": "cpu", "cpu_threads": 1, "max_total_tokens": 4096}

#: the tensor-parallel tests' prompts: one longer than the CPU prefill chunk (256), one
#: sharing its first 200 tokens, one short
PROMPT_A = [(7 * i + 3) % 250 + 3 for i in range(300)]
PROMPT_B = PROMPT_A[:200] + [5, 6, 7, 8, 9, 10]
PROMPT_C = [11, 12, 13]


def seeded_prompts(seed: int = 7, lengths: tuple[int, ...] = (5, 13, 40),
                   high: int = 256) -> list[list[int]]:
    """One prompt per length, token ids drawn uniformly from ``[3, high)`` by a
    ``torch.Generator`` seeded with ``seed`` (the same prompts on every call)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt: list[int], n: int = NEW_TOKENS,
              **generate_kw) -> tuple[list[int], list[float]]:
    """HF ``generate``'s ``n`` greedy tokens after ``prompt`` (no EOS stop) and each chosen
    token's log-probability (log-softmax of its float32 logits); ``generate_kw`` goes to
    ``generate`` (a VL model's ``pixel_values``, say)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **generate_kw)
    toks = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, toks)]
    return toks, lps


def hf_references(hf, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """:func:`hf_greedy` of each prompt."""
    return [hf_greedy(hf, p) for p in prompts]


def case_fixtures(cases, save_tiny, prompts: list[list[int]]):
    """The two module fixtures of a test module parametrized by case names; assign them to
    the module's ``checkpoint`` and ``served``:

    - ``checkpoint``: ``(case, HF model, checkpoint folder, HF reference per prompt)``, the
      tiny checkpoint ``save_tiny(case, folder)`` writes (returning its HF model) under a
      fresh temporary folder, built once per case;
    - ``served``: ``(case, HF model, LLM, HF reference per prompt)``, the checkpoint served
      by :func:`parity_llm` for the module's tests of that case (shut down after them).
    """

    @pytest.fixture(scope="module", params=cases, name="checkpoint")
    def checkpoint(request, tmp_path_factory):
        path = tmp_path_factory.mktemp(request.param)
        hf = save_tiny(request.param, path)
        return request.param, hf, path, hf_references(hf, prompts)

    @pytest.fixture(scope="module", name="served")
    def served(checkpoint):
        case, hf, path, ref = checkpoint
        with parity_llm(path) as llm:
            yield case, hf, llm, ref

    return checkpoint, served


def assert_tokens_match_hf(token_ids: list[int], logprobs: list, ref, what: str,
                           tol: float = LOGPROB_TOL) -> float:
    """``token_ids`` must equal the reference's tokens and each chosen log-prob
    (``logprobs[i][0]``) be within ``tol`` of the reference's; returns the largest
    difference. Raises AssertionError naming ``what``."""
    toks, lps = ref
    assert token_ids == toks, f"{what}: ferry {token_ids} != HF {toks}"
    worst = max(abs(entry[0] - b) for entry, b in zip(logprobs, lps))
    assert worst < tol, f"{what}: log-prob differs from HF by {worst:.2e}"
    return worst


def assert_matches_hf(out, ref, what: str, tol: float = LOGPROB_TOL) -> float:
    """:func:`assert_tokens_match_hf` of one ``LLM.generate`` output."""
    return assert_tokens_match_hf(out.token_ids, out.logprobs, ref, what, tol)


def parity_llm(path, **kw) -> LLM:
    """The offline ``LLM`` on the checkpoint at ``path`` with :data:`CPU_FP32` (``kw``
    overrides or adds arguments); the caller shuts it down (or uses it in ``with``)."""
    return LLM(str(path), **{**CPU_FP32, **kw})


def assert_batch_and_alone_match_hf(llm, prompts: list[list[int]], ref, case: str) -> None:
    """``prompts`` in one batch, then each alone after a cache flush (a prefix-cache miss):
    every output HF's (``ref`` per prompt), and each alone the same tokens as in the batch."""
    batch = llm.generate(prompts, SP)
    for i, (out, r) in enumerate(zip(batch, ref)):
        assert_matches_hf(out, r, f"{case} prompt {i} in a batch")
    for i, p in enumerate(prompts):
        assert llm.scheduler.flush_cache()
        alone = llm.generate([p], SP)[0]
        assert alone.num_cached_tokens == 0          # a prefix-cache miss
        assert_matches_hf(alone, ref[i], f"{case} prompt {i} alone")
        assert alone.token_ids == batch[i].token_ids


def assert_prefix_hits_match_hf(llm, hf, long: list[int], long_ref, case: str) -> None:
    """``long`` (over 32 tokens) run after a cache flush, then again (a hit of at least 32
    tokens), then one sharing its first 32 tokens (a partial hit of at least 24): both
    outputs HF's (``long_ref`` is ``long``'s reference)."""
    assert llm.scheduler.flush_cache()
    assert llm.generate([long], SP)[0].num_cached_tokens == 0     # a miss fills the cache
    again = llm.generate([long], SP)[0]
    assert again.num_cached_tokens is not None and again.num_cached_tokens >= 32
    assert_matches_hf(again, long_ref, f"{case} cached prompt")
    shared = long[:32] + [9, 8, 7, 6, 5]
    out = llm.generate([shared], SP)[0]
    assert out.num_cached_tokens >= 24
    assert_matches_hf(out, hf_greedy(hf, shared), f"{case} shared prefix")


def assert_chunked_prefill_matches_hf(path, hf, long: list[int], long_ref, case: str) -> None:
    """``long`` and a 45-token prompt in one batch, prefilled 16 tokens a step (mixed
    steps) by a fresh :func:`parity_llm` on ``path``: both outputs HF's."""
    longer = [(5 * i + 11) % 250 + 3 for i in range(45)]
    with parity_llm(path, chunked_prefill_size=16) as llm:
        outs = llm.generate([long, longer], SP)
    assert_matches_hf(outs[0], long_ref, f"{case} chunked prompt")
    assert_matches_hf(outs[1], hf_greedy(hf, longer), f"{case} chunked 45-token prompt")


def floats_in(x) -> list[float]:
    """Every float in a nest of lists, tuples and dicts (an output's log-probs), in order."""
    if isinstance(x, float):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [f for item in x for f in floats_in(item)]
    return []
