"""Graph capture on a machine without CUDA or XPU: the device layer is told that the CPU has
graphs, with a stand-in graph class, so that the model runner goes through its real capture
path (``engine/executor/graph_setup.py``). A capture that raises must leave an engine that
runs every step eagerly and generates what an engine without graphs generates, with the
reason in the log; a graph whose replay gives stale logits must be caught by the start-up
comparison with an eager step. The comparison's decision flow is checked with stand-in
runners; the real replays are checked on GPUs (tests/engine/test_graph_check_gpu.py)."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from engine import device as dev
from engine.attention.torch_native import TorchNativeAttnBackend
from engine.loader.loader import config_dir


class _Graph:
    """A graph that replays nothing: its outputs stay those of the capture."""

    def replay(self):
        pass


class _Stream:
    pass


def _pretend_cpu_graphs(monkeypatch, capture):
    monkeypatch.setattr(dev, "graphs_enabled", lambda *a, **k: (True, ""))
    monkeypatch.setattr(dev, "graph_class", lambda d: _Graph)
    monkeypatch.setattr(dev, "stream_class", lambda d: _Stream)
    monkeypatch.setattr(dev, "graph_context", lambda d, g, pool=None, stream=None: capture())
    # the CPU's attention backend, as if it could be captured (its metadata is per step)
    monkeypatch.setattr(TorchNativeAttnBackend, "supports_graphs", True)
    monkeypatch.setattr(TorchNativeAttnBackend, "init_capture", lambda self, max_bs: None)
    monkeypatch.setattr(TorchNativeAttnBackend, "init_forward_graph",
                        TorchNativeAttnBackend.init_forward)


KW = dict(model_path=config_dir("llama-tiny"), load_format="dummy", device="cpu",
          dtype="float32", max_total_tokens=2048, chunked_prefill_size=64,
          max_running_requests=8)


def _generate(llm):
    from engine import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llm.vocab_size, (n,), generator=g).tolist() for n in (3, 40, 9)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_capture_that_raises_runs_eagerly_with_the_reason(monkeypatch, caplog):
    from engine import LLM

    with LLM(**KW) as llm:
        want = _generate(llm)

    @contextlib.contextmanager
    def failing_capture():
        raise RuntimeError("fake capture failure")
        yield

    _pretend_cpu_graphs(monkeypatch, failing_capture)
    with caplog.at_level(logging.WARNING), LLM(**KW) as llm:
        assert llm.runner.graph_runner is None and llm.runner.piecewise_runner is None
        assert _generate(llm) == want
    for what in ("decode graphs", "piecewise graphs"):
        assert f"{what}: graph capture failed on cpu (RuntimeError: fake capture failure); " \
               "these steps run eagerly" in caplog.text


def test_stale_replays_are_caught_at_start_up(monkeypatch, caplog):
    from engine.args import ServerArgs
    from engine.executor.model_runner import ModelRunner

    _pretend_cpu_graphs(monkeypatch, contextlib.nullcontext)  # "captures" run eagerly
    with caplog.at_level(logging.INFO):
        runner = ModelRunner(ServerArgs(**KW))
    assert "captured 4 decode graphs" in caplog.text                 # the capture went fine,
    assert runner.graph_runner is None and runner.piecewise_runner is None   # the check not
    for what in ("decode graphs", "piecewise graphs"):
        assert f"{what}: a replay's logits differ from an eager step's on cpu" in caplog.text
    # the check handed back what it borrowed, in order
    assert runner.kv_pool.free_page_list() == list(range(runner.kv_pool.num_pages, 0, -1))
    assert [runner.req_to_token_pool.alloc() for _ in range(3)] == [1, 2, 3]


def test_skip_env_keeps_unchecked_graphs(monkeypatch):
    from engine.args import ServerArgs
    from engine.executor.model_runner import ModelRunner

    _pretend_cpu_graphs(monkeypatch, contextlib.nullcontext)
    monkeypatch.setenv("FERRY_SKIP_GRAPH_CHECK", "1")
    runner = ModelRunner(ServerArgs(**KW))
    assert runner.graph_runner is not None and runner.piecewise_runner is not None


class _EagerStandIn:
    """A decode/piecewise runner whose replay is the eager step (plus ``error``)."""

    def __init__(self, runner, error=0.0):
        from engine.executor import graph_setup

        self.runner, self.error, self.calls = runner, error, 0
        self.max_bs, self.max_tokens = 8, 512
        self._eager = graph_setup._eager

    def _step(self, batch):
        self.calls += 1
        out = self._eager(self.runner, batch)
        return out + self.error * out.abs().max()

    replay = run = _step


@pytest.fixture(scope="module")
def cpu_runner():
    from engine.args import ServerArgs
    from engine.executor.model_runner import ModelRunner

    return ModelRunner(ServerArgs(**KW))


@pytest.mark.parametrize("gr_err,pw_err", [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1e-6, 1e-6)])
def test_check_decision(cpu_runner, gr_err, pw_err):
    from engine.executor.graph_setup import check_graphs

    r = cpu_runner
    pages, rows = r.kv_pool.free_page_list(), list(r.req_to_token_pool._free)
    gr, pw = _EagerStandIn(r, gr_err), _EagerStandIn(r, pw_err)
    assert check_graphs(r, gr, pw) == (gr_err < 1e-3, pw_err < 1e-3)
    assert gr.calls == 1 and pw.calls == 1
    assert r.kv_pool.free_page_list() == pages and r.req_to_token_pool._free == rows
    assert check_graphs(r, None, pw) == (True, pw_err < 1e-3)
    assert check_graphs(r, gr, None) == (gr_err < 1e-3, True)


class _RaisingStandIn(_EagerStandIn):
    """A decode/piecewise runner whose every replay raises (a graph runtime error)."""

    def can_run(self, n):
        return True

    def _step(self, batch, *a, **k):
        self.calls += 1
        raise RuntimeError("fake replay failure\nsecond line")

    replay = run = _step


@pytest.mark.parametrize("raising", ["decode", "piecewise"])
def test_check_replay_that_raises_drops_that_kind(cpu_runner, raising, caplog):
    """A replay that raises in the start-up check: that kind is dropped with one warning and
    the check carries on (the exception used to stop the engine)."""
    from engine.executor.graph_setup import check_graphs

    r = cpu_runner
    pages, rows = r.kv_pool.free_page_list(), list(r.req_to_token_pool._free)
    gr = _RaisingStandIn(r) if raising == "decode" else _EagerStandIn(r)
    pw = _RaisingStandIn(r) if raising == "piecewise" else _EagerStandIn(r)
    with caplog.at_level(logging.WARNING):
        assert check_graphs(r, gr, pw) == (raising != "decode", raising != "piecewise")
    what = f"{raising} graphs"
    warnings = [m for m in caplog.messages if "a replay raised" in m]
    assert warnings == [f"{what}: a replay raised on cpu (RuntimeError: fake replay failure); "
                        "these steps run eagerly from now on"]
    assert r.kv_pool.free_page_list() == pages and r.req_to_token_pool._free == rows


def test_serving_replay_that_raises_runs_eagerly(monkeypatch, caplog):
    """A replay that raises while serving: that step and the later ones run eagerly, with
    one warning per kind of graph, and generate what an engine without graphs generates."""
    from engine import LLM

    with LLM(**KW) as llm:
        want = _generate(llm)
    _pretend_cpu_graphs(monkeypatch, contextlib.nullcontext)
    monkeypatch.setenv("FERRY_SKIP_GRAPH_CHECK", "1")  # keep the "captured" graphs
    with LLM(**KW) as llm:
        r = llm.runner
        assert r.graph_runner is not None and r.piecewise_runner is not None
        gr, pw = _RaisingStandIn(r), _RaisingStandIn(r)
        r.graph_runner, r.piecewise_runner = gr, pw
        with caplog.at_level(logging.WARNING):
            assert _generate(llm) == want
            assert _generate(llm) == want
        assert r.graph_runner is None and r.piecewise_runner is None
        assert gr.calls == 1 and pw.calls == 1
    warnings = [m for m in caplog.messages if "a replay raised" in m]
    assert sorted(warnings) == [
        f"{what}: a replay raised on cpu (RuntimeError: fake replay failure); these steps "
        "run eagerly from now on" for what in ("decode graphs", "piecewise graphs")]


def test_check_batch_has_thousands_of_tokens_in_flight():
    """With room for it, the start-up check runs 7 requests and 2180 tokens (was 3 requests
    and 147 tokens: a decode replay over a short KV checks little of the split-KV path);
    smaller pools and steps shrink it."""
    import types

    from engine.executor.graph_setup import _check_lens

    def runner(free_tokens, rows=256, ctx=8192):
        kv = types.SimpleNamespace(free_tokens=lambda: free_tokens, page_size=1)
        pool = types.SimpleNamespace(available=lambda: rows)
        return types.SimpleNamespace(kv_pool=kv, req_to_token_pool=pool, max_context_len=ctx)

    lens = _check_lens(runner(1 << 20), max_bs=256, max_tokens=2304)
    assert len(lens) >= 7 and sum(lens) >= 2000 and max(lens) >= 1000
    small = _check_lens(runner(1 << 20), max_bs=4, max_tokens=512)
    assert len(small) == 4 and sum(small) <= 512
    assert _check_lens(runner(700), max_bs=256, max_tokens=2304) != []
