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
import torch

pytest.importorskip("triton")

from kernel_test_utils import ON_GPU

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(ON_GPU, reason="the interpreter run of the GPU path")]

STEPS = 12


def _hf(hf, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                          do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[0, len(prompt):].tolist()
    return toks, [torch.log_softmax(lg[0].float(), -1)[t].item()
                  for lg, t in zip(out.logits, toks)]


def test_deepseek_v3_through_the_triton_mla_backend(tmp_path):
    from deepseek_helpers import save_tiny

    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    hf = save_tiny("v3", tmp_path)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 40, 23)]
    sp = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=1)
    with LLM(str(tmp_path), dtype="float32", device="cpu", cpu_threads=1,
             max_total_tokens=2048, chunked_prefill_size=16,
             attention_backend="triton") as llm:
        assert type(llm.runner.attn_backend).__name__ == "TritonMLABackend"
        outs = llm.generate(prompts, sp)
        again = llm.generate([prompts[1]], sp)[0]
    assert again.num_cached_tokens >= 32
    for out, prompt in zip([*outs, again], [*prompts, prompts[1]]):
        toks, lps = _hf(hf, prompt)
        assert out.token_ids == toks
        worst = max(abs(e[0] - b) for e, b in zip(out.logprobs, lps))
        assert worst < 1e-3, worst
