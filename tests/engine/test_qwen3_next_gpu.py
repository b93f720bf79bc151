"""Qwen3-Next on the GPU (marker gpu): the tiny random checkpoint of ``qwen3_next_helpers``
served by ``LLM`` on CUDA in float32, whose linear layers run fla-core's kernels (the torch
reference where fla-core is missing), gives HF's greedy tokens (HF on the CPU, its torch
path) in a batch of different lengths, with chunked prefill, and gives every state slot
back."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformers.models.qwen3_next")

NEW_TOKENS = 12


def test_tiny_qwen3_next_on_the_gpu_matches_hf(tmp_path):
    from qwen3_next_helpers import save_tiny

    from engine.llm import LLM
    from engine.sampling.params import SamplingParams
    from kernels.linear_attention import gated_delta_rule_backend

    hf = save_tiny("qwen3_next", tmp_path)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 13, 70, 150)]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    print("gated delta rule backend:", gated_delta_rule_backend("cuda"))
    with LLM(str(tmp_path), dtype="float32", device="cuda", max_total_tokens=4096,
             chunked_prefill_size=64, disable_cuda_graph=True) as llm:
        outs = llm.generate(prompts, sp)
        pool = llm.runner.state_pool
        assert pool.available() == pool.num_slots
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r, f"prompt {i}: ferry {o.token_ids} != HF {r}"
