"""The windowed KV pool on an accelerator (marker gpu): the tiny dummy Llama with two of every
three layers made sliding-window ones (window 24, ``test_windowed_kv.py``'s override) gives
the same greedy tokens with the windowed pool, decode graphs, piecewise graphs and overlap
scheduling as with one pool run eagerly, for prompts and decodes well past the window."""

import pytest
import torch

from engine.device import resolve_device
from tests.engine.test_windowed_kv import windowed_model  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.gpu
DEVICE = resolve_device("auto")
if DEVICE == "cpu":
    pytest.skip("needs a CUDA or XPU device", allow_module_level=True)


def _outputs(**kw):
    from engine import LLM, SamplingParams
    from engine.loader.loader import config_dir

    llm = LLM(model_path=config_dir("llama-tiny"), load_format="dummy", device=DEVICE,
              dtype="float32", max_total_tokens=4096, chunked_prefill_size=64,
              enable_xpu_graph=True, **kw)
    llm.scheduler.check_kv = True
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llm.vocab_size, (n,), generator=g).tolist()
               for n in (3, 17, 70, 9, 33, 129, 1, 50)]
    greedy = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    alone = [llm.generate([p], greedy)[0].token_ids for p in prompts[:3]]
    batched = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert llm.scheduler.kv.used_tokens() == 0
    return alone, batched, llm


@pytest.mark.parametrize("page_size", [1, 16])
def test_windowed_pool_with_graphs_and_overlap_matches_one_eager_pool(page_size):
    base_alone, base, llm = _outputs(swa_full_tokens_ratio=0, disable_overlap_schedule=True,
                                     disable_cuda_graph=True, page_size=page_size)
    assert llm.runner.swa_pool is None
    alone, fast, llm = _outputs(page_size=page_size)
    assert llm.runner.swa_pool is not None and llm.runner.graph_runner is not None
    assert llm.scheduler.overlap
    assert alone == base_alone
    assert fast == base
