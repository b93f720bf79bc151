"""``LLM.generate``'s per-prompt lists (``lora``, ``sampling_params``) on a tiny seeded random
Llama with one peft adapter (``lora_helpers``): a list whose length is not the number of
prompts, or a ``lora`` that is not a name, is a ``RequestError`` naming the argument before
anything runs (zip had dropped the extra prompts: ``lora=["a"]`` for two prompts returned
one output; a tuple was looked up as a name). Checked against hand-written expectations;
a list of the right length still runs each prompt on its own adapter (its tokens against
the same prompts run one adapter at a time).
"""

from __future__ import annotations

import pytest
from lora_helpers import ALL_MODULES, save_adapter, save_llama

from engine.sampling.params import SamplingParams
from engine.validation import RequestError

PROMPTS = [[5, 9, 14, 3, 77, 120, 31], [200, 201, 7, 7]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from engine import LLM

    root = tmp_path_factory.mktemp("lora_lists")
    save_llama(root / "base")
    save_adapter(root / "base", root / "a", seed=1, r=8, targets=ALL_MODULES)
    engine = LLM(str(root / "base"), lora_paths=[f"a={root / 'a'}"], device="cpu",
                 max_total_tokens=1024, cpu_threads=1)
    yield engine
    engine.shutdown()


def _sp():
    return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("kw,param,match", [
    ({"lora": ["a"]}, "lora", "1 entries for 2 prompts"),
    ({"lora": ["a", None, "a"]}, "lora", "3 entries for 2 prompts"),
    ({"lora": []}, "lora", "0 entries for 2 prompts"),
    ({"sampling_params": [SamplingParams(max_tokens=2)]}, "sampling_params",
     "1 entries for 2 prompts"),
    ({"lora": ("a", None)}, "lora", "got tuple"),
    ({"lora": 5}, "lora", "got int"),
    ({"lora": ["a", 5]}, "lora", "got int"),
])
def test_refused_before_anything_runs(llm, kw, param, match):
    args = {"sampling_params": _sp(), **kw}
    with pytest.raises(RequestError, match=match) as ei:
        llm.generate(PROMPTS, **args)
    assert ei.value.param == param
    assert llm.scheduler.num_waiting == 0 and llm.scheduler.num_running == 0


def test_one_adapter_per_prompt_still_runs(llm):
    alone = [llm.generate([p], _sp(), lora=name)[0].token_ids
             for p, name in zip(PROMPTS, ["a", None])]
    both = llm.generate(PROMPTS, _sp(), lora=["a", None])
    assert [o.token_ids for o in both] == alone
    assert llm.generate(PROMPTS, [_sp(), _sp()], lora="a")[1].token_ids == \
        llm.generate([PROMPTS[1]], _sp(), lora="a")[0].token_ids
