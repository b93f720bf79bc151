"""The radix prefix cache on the real model (SmolLM2-135M, fp32, CPU): greedy output with the
cache on equals the output with ``--disable-radix-cache`` (whose agreement with HF
transformers test_generate.py proves), for prompts that share a prefix at every kind of
boundary, under chunking, eviction and preemption. The page accounting is checked after
every step of every run."""

import pytest

pytestmark = pytest.mark.slow

HEADER = ("You are a careful assistant. Answer in one short sentence, plainly, without "
          "lists. The user is curious about geography and history.\n")
QUESTIONS = ["Q: What is the capital of France?\nA:", "Q: Who built the pyramids?\nA:",
             "Q: Name a river in Egypt.\nA:"]
NEW = 10


def _llm(**kw):
    from engine import LLM

    llm = LLM(model_path=None, device="cpu", max_total_tokens=kw.pop("max_total_tokens", 4096),
              **kw)
    llm.scheduler.check_kv = True
    return llm


@pytest.fixture(scope="module")
def off():
    return _llm(disable_radix_cache=True, chunked_prefill_size=64)


def _greedy(llm, prompts, **kw):
    from engine import SamplingParams

    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, **kw)
    return llm.generate(prompts, sp)


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefixes_at_every_boundary_match_the_cache_off_output(off, page_size):
    on = _llm(page_size=page_size, chunked_prefill_size=64)
    tok = on.tokenizer
    first = HEADER + QUESTIONS[0]
    ids = tok.encode(first)
    prompts = [
        first,                                  # warms the cache
        first,                                  # the same prompt again: all but its last token
        HEADER + QUESTIONS[1],                  # the header, then a different question
        ids[: len(ids) - 5],                    # a prefix of a cached prompt
        ids[:17] + [tok.encode(" x")[0]] + ids[18:],  # diverges inside a page (page 4)
        ids[:16] + ids[20:],                    # diverges on a page edge
    ]
    for p in prompts:  # one at a time, so each finds what the ones before it cached
        got = _greedy(on, [p])[0]
        want = _greedy(off, [p])[0]
        assert got.token_ids == want.token_ids, p if isinstance(p, str) else len(p)
    hits = on.scheduler.stats["prefix_cache_hits"]
    assert hits >= (len(ids) - 1) // page_size * page_size  # at least the repeat hit fully
    assert on.scheduler.kv.used_tokens() == 0


def test_concurrent_chunked_prefill_eviction_and_preemption(off):
    """A pool too small for the batch (preemption, eviction of cached prefixes), prompts
    prefilled in chunks of 16 while others with the same header arrive, and a repeated prompt
    in one batch (like n > 1): every output equals the cache-off run of the same prompt."""
    on = _llm(page_size=4, chunked_prefill_size=16, max_total_tokens=192)
    prompts = [HEADER + q for q in QUESTIONS] * 2 + [HEADER]
    got = _greedy(on, prompts)
    want = {p: _greedy(off, [p])[0].token_ids for p in set(prompts)}
    for p, o in zip(prompts, got):
        assert o.token_ids == want[p]
    st = on.scheduler.stats
    assert st["prefix_cache_hits"] > 0
    assert st["preemptions"] > 0 or on.scheduler.kv.tree.total_pages < 48
    assert on.scheduler.kv.used_tokens() == 0


def test_logprobs_and_echo_bypass_the_cache_for_the_prompt(off):
    """Prompt logprobs need the logits of every prompt position, so such a request matches
    nothing (it recomputes its prompt) yet still fills the cache for others."""
    on = _llm(chunked_prefill_size=64)
    p = HEADER + QUESTIONS[2]
    _greedy(on, [p])  # cached now
    got = _greedy(on, [p], logprobs=2, prompt_logprobs=2)[0]
    want = _greedy(off, [p], logprobs=2, prompt_logprobs=2)[0]
    assert got.token_ids == want.token_ids
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(got.prompt_token_ids)
    for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert abs(a[0] - b[0]) < 1e-4
    for a, b in zip(got.logprobs, want.logprobs):
        assert abs(a[0] - b[0]) < 1e-4
    reqs_hits = on.scheduler.stats["prefix_cache_hits"]
    assert reqs_hits == 0  # the logprobs request looked nothing up
