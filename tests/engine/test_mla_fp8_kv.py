"""``--kv-cache-dtype fp8_e4m3`` on a tiny DeepSeek-V3 (MLA over the latent pool, CPU, fp32):
the latent pool holds e4m3 (one byte a value), and the greedy tokens follow the fp32 cache's.

Tolerance, from e4m3's precision: each stored latent value is within 2^-4 (half a unit in
the last of its 3 mantissa bits) of its fp32 value, so the scores and the attention outputs
move by a few percent of their size; on this tiny model (log-probs near -3.5, a logit spread
of about 1) that shifts a chosen token's log-probability by up to ~0.09 (measured), below
:data:`LP_TOL`. So while the two runs' tokens agree, their log-probs must stay within
``LP_TOL``; where they first part, the fp32 run's best two tokens must have been within
``2 * LP_TOL`` of each other (a near-tie the rounding may flip: this random model has
margins of 0.003-0.02 at such steps), and every prompt must agree for at least its first
step. The FP8 result must not depend on where chunked prefill cuts the prompts (the new
tokens are attended to as stored): tokens equal and log-probs within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_helpers import save_tiny
from parity_helpers import parity_llm, seeded_prompts

from engine.kv.pool import LatentKVPool
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

#: the largest log-prob shift of an agreeing step (module docstring)
LP_TOL = 0.15
SP2 = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
PROMPTS = seeded_prompts(lengths=(5, 13, 40, 70, 27, 90))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny V3 checkpoint's outputs with an fp32 cache, an e4m3 cache, and an e4m3 cache
    prefilled 16 tokens a step; the e4m3 pool's layer-0 buffer."""
    path = tmp_path_factory.mktemp("v3_fp8kv")
    save_tiny("v3", path)
    outs = {}
    for name, kw in (("fp32", {}), ("fp8", {"kv_cache_dtype": "fp8_e4m3"}),
                     ("fp8_chunked", {"kv_cache_dtype": "fp8_e4m3",
                                      "chunked_prefill_size": 16})):
        with parity_llm(path, **kw) as llm:
            outs[name] = llm.generate(PROMPTS, SP2)
            if name == "fp8":
                pool = llm.runner.kv_pool
    return outs, pool


def test_the_latent_pool_holds_e4m3(runs):
    _, pool = runs
    assert isinstance(pool, LatentKVPool)
    assert pool.k_buffers[0].dtype == torch.float8_e4m3fn
    # 3 layers of kv_lora_rank 16 + rope 8 values, one byte each (fp32: four)
    assert LatentKVPool.bytes_per_token(3, pool.latent_dim, pool.dtype) == 3 * 24


def test_greedy_tokens_follow_the_fp32_cache(runs):
    outs, _ = runs
    agreed = []
    for i, (a, b) in enumerate(zip(outs["fp32"], outs["fp8"])):
        n = 0
        while n < len(a.token_ids) and a.token_ids[n] == b.token_ids[n]:
            shift = abs(a.logprobs[n][0] - b.logprobs[n][0])
            assert shift < LP_TOL, f"prompt {i} step {n}: log-prob moved by {shift:.3f}"
            n += 1
        agreed.append(n)
        if n < len(a.token_ids):
            best = sorted((lp for _, lp in a.logprobs[n][1]), reverse=True)
            assert best[0] - best[1] < 2 * LP_TOL, \
                f"prompt {i} step {n}: tokens part at a margin of {best[0] - best[1]:.3f}"
    assert min(agreed) >= 1 and sum(agreed) >= 3 * len(PROMPTS), agreed


def test_fp8_result_does_not_depend_on_chunking(runs):
    outs, _ = runs
    for i, (a, b) in enumerate(zip(outs["fp8"], outs["fp8_chunked"])):
        assert a.token_ids == b.token_ids, f"prompt {i}"
        worst = max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs))
        assert worst < 1e-4, f"prompt {i}: log-probs differ by {worst:.2e} between chunkings"
