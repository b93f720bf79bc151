"""Gemma 4 through the Triton attention backend (the interpreter on the CPU): global layers
twice as wide as the sliding ones (the decode workspaces are sized by the widest head and
sliced per layer) and KV-sharing layers (no K/V stored; the extend kernel reads this step's
K/V of the source layer from the pool). ferry's greedy tokens and log-probabilities must be
HF's, in a batch of two prompts over decode steps."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("triton")

from conftest import DEVICE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter run (CPU)")]


def test_gemma4_on_the_triton_backend_matches_hf(tmp_path):
    from gemma_helpers import save_tiny
    from parity_helpers import assert_matches_hf, hf_greedy, parity_llm, seeded_prompts

    from engine.sampling.params import SamplingParams

    hf = save_tiny("gemma4", tmp_path)
    prompts = seeded_prompts(high=250)[:2]          # test_gemma_models' first two prompts
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    with parity_llm(tmp_path, max_total_tokens=1024, attention_backend="triton") as llm:
        assert llm.runner.attn_backend.max_head_dim == 32
        outs = llm.generate(prompts, sp)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert_matches_hf(out, hf_greedy(hf, p, 4), f"gemma4, Triton backend, prompt {i}")
