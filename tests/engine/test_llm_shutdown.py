"""``LLM.shutdown`` gives the engine's memory back: nothing of the model survives it, and the
object refuses to generate afterwards with a clear error (a second ``LLM`` in the same process
sizes its KV pool from the free memory the first one left)."""

import gc
import weakref

import pytest

from engine.llm import LLM
from engine.sampling.params import SamplingParams

TINY = "engine/configs/llama-tiny.json"


@pytest.mark.parametrize("tp", [1, 2])   # TP: rank 0's runner was held by its atexit hook
def test_shutdown_frees_the_model_and_refuses_to_generate(tp):
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with LLM(TINY, load_format="dummy", device="cpu", cpu_threads=1, seed=1,
             tp_size=tp) as llm:
        model = weakref.ref(llm.runner.model)
        kv = weakref.ref(llm.scheduler)
        assert len(llm.generate([[5, 6, 7]], sp)[0].token_ids) == 3
    gc.collect()
    assert model() is None and kv() is None, "the model or the scheduler outlived shutdown()"
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], sp)
    llm.shutdown()                       # idempotent
    with pytest.raises(AttributeError):
        llm.no_such_attribute            # noqa: B018 - other names keep AttributeError
