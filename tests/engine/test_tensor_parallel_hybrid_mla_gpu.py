"""Tensor parallelism of the hybrid (Gated DeltaNet) and MLA models on two GPUs (marker gpu):
the tiny Qwen3-Next and DeepSeek-V3 checkpoints of the CPU test
(tests/engine/test_tensor_parallel_hybrid_mla.py) at TP=2 must give one GPU's tokens and
log-probabilities: FLA's kernels (or the torch reference) over each rank's heads and state
slots, the Triton MLA kernels over each rank's heads (DeepSeek with its decode graphs, which
then hold the NCCL all-reduces), EP=2 for DeepSeek's experts. Prefix-cache hits included
(a prompt cut from a cached one, the long prompt's next turn): on Qwen3-Next each rank
restores its own state snapshots, in stream order with overlap scheduling; the cached token
counts are one GPU's."""

import deepseek_helpers
import pytest
import qwen3_next_helpers
from parity_helpers import PROMPT_A, PROMPT_C, seeded_prompts

from engine import device as dev
from engine.device import resolve_device

pytestmark = pytest.mark.gpu
DEVICE = resolve_device("auto")
if DEVICE == "cpu" or dev.visible_device_count(DEVICE) < 2:
    pytest.skip("needs two CUDA or XPU devices", allow_module_level=True)

CASES = {"qwen3_next": (qwen3_next_helpers, "qwen3_next", {"disable_cuda_graph": True}),
         "deepseek_v3": (deepseek_helpers, "v3", {})}


def _run(path, **kw):
    from engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(str(path), device=DEVICE, dtype="float32", max_total_tokens=4096,
             chunked_prefill_size=64, **kw) as llm:
        outs = llm.generate([PROMPT_A, PROMPT_C, *seeded_prompts()], sp)
        outs += llm.generate([PROMPT_C, PROMPT_A[:90]], sp)
        outs += llm.generate([PROMPT_A + list(outs[0].token_ids) + [21, 22, 23]], sp)
    return ([o.token_ids for o in outs], [lp for o in outs for lp, _ in o.logprobs],
            [o.num_cached_tokens for o in outs])


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_one_gpu(case, tmp_path):
    helpers, name, flags = CASES[case]
    helpers.save_tiny(name, tmp_path)
    ref_toks, ref_lps, ref_cached = _run(tmp_path, tp_size=1, **flags)
    assert ref_cached[-1] > 0                        # the next turn hits the prefix cache
    runs = [{"tp_size": 2}] + ([{"tp_size": 2, "ep_size": 2}] if case == "deepseek_v3" else [])
    for kw in runs:
        toks, lps, cached = _run(tmp_path, **kw, **flags)
        assert cached == ref_cached, kw
        assert toks == ref_toks, kw
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-3, kw
