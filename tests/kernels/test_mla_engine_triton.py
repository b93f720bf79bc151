"""A tiny DeepSeek-V3 checkpoint served by the offline ``LLM`` with ``--attention-backend
triton`` (the GPU path of MLA: ``TritonMLABackend``, the kernels of ``kernels/mla/``, run
here in Triton's interpreter, fp32) against HF ``generate``: greedy tokens equal and
log-probs within 1e-3 over 12 steps, through the real step builder: a batch of different
lengths prefilled 16 tokens a step (mixed steps: chunks beside decode rows), then a prefix
cache hit."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("triton")

from kernel_test_utils import ON_GPU

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))

from parity_helpers import SP, assert_matches_hf, hf_greedy, parity_llm, seeded_prompts  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(ON_GPU, reason="the interpreter run of the GPU path")]


def test_deepseek_v3_through_the_triton_mla_backend(tmp_path):
    from deepseek_helpers import save_tiny

    hf = save_tiny("v3", tmp_path)
    prompts = seeded_prompts(lengths=(5, 40, 23))
    with parity_llm(tmp_path, max_total_tokens=2048, chunked_prefill_size=16,
                    attention_backend="triton") as llm:
        assert type(llm.runner.attn_backend).__name__ == "TritonMLABackend"
        outs = llm.generate(prompts, SP)
        again = llm.generate([prompts[1]], SP)[0]
    assert again.num_cached_tokens >= 32
    for i, (out, prompt) in enumerate(zip([*outs, again], [*prompts, prompts[1]])):
        assert_matches_hf(out, hf_greedy(hf, prompt), f"output {i}")
