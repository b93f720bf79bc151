"""The start-up graph check on a GPU (marker gpu): a decode-graph replay and a piecewise
replay agree with eager steps (fp32 and bf16, so the 16-bit tolerance is exercised on real
padded batches), and a replay that returns wrong logits is dropped at start-up while the
engine still generates what an eager engine generates. On XPU the graphs are asked for with
``--enable-xpu-graph`` (opt-in before torch 2.14); this is the test that says whether they
can be trusted on a given card and driver."""

from __future__ import annotations

import pytest
import torch

from engine.device import resolve_device

pytestmark = pytest.mark.gpu
DEVICE = resolve_device("auto")
if DEVICE == "cpu":
    pytest.skip("needs a CUDA or XPU device", allow_module_level=True)


def _args(dtype, **kw):
    from engine.args import ServerArgs
    from engine.loader.loader import config_dir

    return ServerArgs(model_path=config_dir("llama-tiny"), load_format="dummy", device=DEVICE,
                      dtype=dtype, max_total_tokens=4096, chunked_prefill_size=64,
                      max_running_requests=8, enable_xpu_graph=True, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replays_match_eager_steps(dtype, caplog):
    from engine.executor.graph_setup import check_graphs
    from engine.executor.model_runner import ModelRunner

    with caplog.at_level("INFO"):
        runner = ModelRunner(_args(dtype))
    gr, pw = runner.graph_runner, runner.piecewise_runner
    assert gr is not None and pw is not None, caplog.text
    assert "decode graphs: a replay matches an eager step" in caplog.text
    assert "piecewise graphs: a replay matches an eager step" in caplog.text
    free = runner.kv_pool.free_page_list()
    assert check_graphs(runner, gr, pw) == (True, True)  # and again, on a warm engine
    assert runner.kv_pool.free_page_list() == free


def test_a_wrong_replay_is_dropped_at_start_up(monkeypatch, caplog):
    from engine import LLM, SamplingParams
    from engine.executor.graph_runner import GraphRunner

    def run(**kw):
        g = torch.Generator().manual_seed(0)
        with LLM(**vars(_args("float32", **kw))) as llm:
            prompts = [torch.randint(0, llm.vocab_size, (n,), generator=g).tolist()
                       for n in (3, 17, 70)]
            outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                        ignore_eos=True))
            return [o.token_ids for o in outs], llm.runner.graph_runner

    want, _ = run(disable_cuda_graph=True)
    real = GraphRunner.replay
    monkeypatch.setattr(GraphRunner, "replay",
                        lambda self, batch, future_ids=None: real(self, batch, future_ids) + 5.0)
    with caplog.at_level("WARNING"):
        got, gr = run()
    assert gr is None
    assert "decode graphs: a replay's logits differ from an eager step's" in caplog.text
    assert got == want
