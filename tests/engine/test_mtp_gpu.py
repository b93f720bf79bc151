"""MTP speculative decoding on a GPU (marker gpu): the tiny random DeepSeek-V3 with an MTP
layer (MLA through the Triton MLA backend: its verify rows through the decode graphs, the
MTP head's rounds through its own graphs where their replay matches the eager step) and
the tiny Qwen3-Next (its verify steps through the verify graphs, and eagerly with graphs
off: the Triton decode kernels in their verify mode, each row's state to a scratch slot),
float32: greedy output with MTP must be the target's without it, and the arranged
``oracle`` MTP layer's drafts must be accepted."""

from __future__ import annotations

import pytest

from engine.device import resolve_device

pytestmark = pytest.mark.gpu
DEVICE = resolve_device("auto")
if DEVICE != "cuda":
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[5, 9, 14, 3, 77, 120, 31], list(range(40, 80)), [200, 201, 7]]


def _pair(path, **kw):
    from engine import LLM, SamplingParams

    kw = dict(device=DEVICE, dtype="float32", max_total_tokens=4096, chunked_prefill_size=16,
              **kw)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), **kw).generate(PROMPTS, sp)]
    spec = LLM(str(path), speculative_algorithm="MTP", speculative_num_steps=3, **kw)
    spec.scheduler.check_kv = True
    got = [o.token_ids for o in spec.generate(PROMPTS, sp)]
    return spec, got, want


@pytest.mark.parametrize("oracle", [False, True])
def test_deepseek_mtp_on_the_gpu(tmp_path, oracle):
    from deepseek_helpers import save_tiny
    from mtp_helpers import add_deepseek_mtp

    save_tiny("v3", tmp_path)
    add_deepseek_mtp(tmp_path, oracle=oracle)
    spec, got, want = _pair(tmp_path)
    assert spec.runner.graph_runner is not None  # the target's decode graphs stay on
    print("MTP head graphs:", spec.scheduler.spec.proposer.head_graphs is not None)
    assert got == want
    st = spec.scheduler.stats
    assert st["spec_proposed_tokens"] > 0
    if oracle:
        assert st["spec_accepted_tokens"] >= 0.9 * st["spec_proposed_tokens"]


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("oracle", [False, True])
def test_qwen3_next_mtp_on_the_gpu(tmp_path, oracle, graphs):
    pytest.importorskip("transformers.models.qwen3_next")
    from mtp_helpers import add_qwen_mtp
    from qwen3_next_helpers import save_tiny

    save_tiny("qwen3_next", tmp_path)
    add_qwen_mtp(tmp_path, 3, oracle=oracle)
    spec, got, want = _pair(tmp_path, disable_cuda_graph=not graphs)
    gr = spec.runner.graph_runner
    assert (gr is not None and bool(gr.verify_graphs)) == graphs
    assert got == want
    st = spec.scheduler.stats
    assert st["spec_proposed_tokens"] > 0
    if oracle:
        assert st["spec_accepted_tokens"] >= 0.9 * st["spec_proposed_tokens"]
    assert spec.runner.state_pool.available() == spec.runner.state_pool.num_slots
