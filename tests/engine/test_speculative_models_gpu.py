"""Speculative decoding with model proposers on an accelerator (marker gpu): with the
target's decode graphs (which keep an EAGLE head's hidden states) and the draft's own
graphs, greedy float32 output must be the target's without speculation."""

import pytest

from engine.device import resolve_device

pytestmark = pytest.mark.gpu
DEVICE = resolve_device("auto")
if DEVICE == "cpu":
    pytest.skip("needs a CUDA or XPU device", allow_module_level=True)


@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE", "EAGLE3"])
def test_model_proposers_with_graphs_keep_greedy_output(tmp_path, algo):
    from test_speculative_models import PROMPTS, save_head, save_knowing_pair, save_llama

    from engine import LLM, SamplingParams

    kw = dict(device=DEVICE, dtype="float32", max_total_tokens=4096, chunked_prefill_size=16,
              enable_xpu_graph=True)
    if algo == "EAGLE":
        target, draft = save_knowing_pair(tmp_path)
    else:
        target = str(tmp_path / "t")
        save_llama(target, layers=4, seed=3)
        draft = str(tmp_path / "d")
        if algo == "EAGLE3":
            save_head(draft, True, seed=5)
        else:
            save_llama(draft, layers=1, seed=11)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = LLM(target, **kw)
    want = [o.token_ids for o in base.generate(PROMPTS, sp)]
    spec = LLM(target, speculative_algorithm=algo, speculative_draft_model_path=draft,
               speculative_num_steps=3, **kw)
    assert spec.runner.graph_runner is not None  # the decode graphs stay on
    spec.scheduler.check_kv = True
    assert [o.token_ids for o in spec.generate(PROMPTS, sp)] == want
    st = spec.scheduler.stats
    assert st["spec_proposed_tokens"] > 0
    if algo == "EAGLE":  # the head that knows the target: drafts accepted through graphs
        assert st["spec_accepted_tokens"] > 0
