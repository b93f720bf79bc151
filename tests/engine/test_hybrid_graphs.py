"""Decode graphs of the hybrid models (Qwen3-Next, Qwen3.5: Gated DeltaNet + gated full
attention) on the CPU, through a stand-in of graph capture that records and replays.

The CPU has no graphs, so the device layer is told it has one (as in
``tests/engine/test_graph_fallback.py``) whose capture records every aten / custom op the
decode step dispatches (a ``TorchDispatchMode``) with the very tensors it read and wrote,
and whose replay re-runs that tape in order, writing each op's result back into the
tensor the capture produced. Like a device graph, a replay therefore sees only what the
static buffers (``engine/executor/graph_runner.py``) and the pools hold at replay time:
anything the step took from the host at capture (a batch's slots, a length) stays baked in,
and a host sync inside the capture (``.item()``, ``.tolist()``) raises. Two kinds of call
are kept whole (re-run at replay, not recorded op by op): the CPU attention backend's
per-step planning and decode attention, which plan from the host on the CPU (on GPUs the
Triton backend plans on the device from the same static buffers), and the CPU MoE, whose
per-expert loop syncs (the GPU runs the fused Triton MoE).

Checked: the engine starts with decode graphs captured and the start-up replay check passed
(piecewise graphs off, said in the log); greedy generation with the graphs equals an eager
engine's tokens and log-probs for batches smaller than the captured buckets (padding rows on
the scratch slot 0), with more requests than state slots (a finished request's slot reused
by a waiting one), and a second round (slots reused again); decode steps did replay.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from engine import device as dev
from engine.attention.torch_native import TorchNativeAttnBackend
from engine.layers.moe import FusedMoE

pytestmark = pytest.mark.slow


class _Graph:
    """A recorded decode step: ``ops`` holds ``(func, args, kwargs, out)`` per dispatched
    op and ``(callable, args, kwargs, out)`` per call kept whole (``whole`` True)."""

    replays = 0

    def __init__(self):
        self.ops: list[tuple] = []

    @torch.inference_mode()
    def replay(self) -> None:
        type(self).replays += 1
        for fn, args, kwargs, out in self.ops:
            new = fn(*args, **kwargs)
            for old, fresh in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if isinstance(old, torch.Tensor) and old.numel() and \
                        old.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr():
                    old.copy_(fresh)  # a fresh result: into the tensor the capture made


class _Recorder(TorchDispatchMode):
    """Records the ops of a capture into ``graph``; a host sync raises, as on a GPU."""

    active: _Recorder | None = None

    def __init__(self, graph: _Graph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a host sync (.item()) inside a graph capture")
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


@contextlib.contextmanager
def _capture(graph: _Graph):
    rec = _Recorder(graph)
    _Recorder.active = rec
    try:
        with rec:
            yield
    finally:
        _Recorder.active = None


def _whole(fn):
    """``fn`` kept whole in a capture: run with the recording paused, re-run at replay."""

    def call(*args, **kwargs):
        rec = _Recorder.active
        if rec is None:
            return fn(*args, **kwargs)
        _Recorder.active = None
        try:
            with _disable_current_modes():
                out = fn(*args, **kwargs)
        finally:
            _Recorder.active = rec
        rec.graph.ops.append((fn, args, kwargs, out))
        return out

    return call


def _no_tolist(orig):
    def tolist(self):
        if _Recorder.active is not None:
            raise RuntimeError("a host sync (.tolist()) inside a graph capture")
        return orig(self)

    return tolist


def _pretend_recorded_graphs(monkeypatch):
    monkeypatch.setattr(dev, "graphs_enabled", lambda *a, **k: (True, ""))
    monkeypatch.setattr(dev, "graph_class", lambda d: _Graph)
    monkeypatch.setattr(dev, "stream_class", lambda d: type("_Stream", (), {}))
    monkeypatch.setattr(dev, "graph_context",
                        lambda d, g, pool=None, stream=None: _capture(g))
    monkeypatch.setattr(torch.Tensor, "tolist", _no_tolist(torch.Tensor.tolist))
    tn = TorchNativeAttnBackend
    monkeypatch.setattr(tn, "supports_graphs", True)
    monkeypatch.setattr(tn, "init_capture", lambda self, max_bs: None)
    monkeypatch.setattr(tn, "init_forward_graph", _whole(tn.init_forward))
    monkeypatch.setattr(tn, "forward_decode", _whole(tn.forward_decode))
    monkeypatch.setattr(FusedMoE, "forward", _whole(FusedMoE.forward))


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def checkpoint(request, tmp_path_factory):
    from qwen3_next_helpers import save_tiny

    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path)
    return str(path)


def _kw(path):
    # 3 state slots (max_running_requests), buckets 1, 2 and 4 (4 >= 3: padding rows)
    return dict(model_path=path, device="cpu", dtype="float32", max_total_tokens=2048,
                chunked_prefill_size=64, max_running_requests=3, cuda_graph_max_bs=4)


def _rounds(llm):
    """Two rounds of greedy generation: 5 requests of different lengths and budgets over 3
    slots (decode batches of 3, 2 and 1 rows; waiting requests take finished requests'
    slots), then 2 more (the slots again)."""
    from engine.sampling.params import SamplingParams

    g = torch.Generator().manual_seed(3)
    outs = []
    for lens, budgets in (((5, 23, 9, 40, 2), (6, 11, 3, 8, 5)), ((17, 4), (7, 9))):
        prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
        sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1)
               for m in budgets]
        for o in llm.generate(prompts, sps):
            outs.append((list(o.token_ids), [float(e[0]) for e in o.logprobs]))
    pool = llm.runner.state_pool
    assert pool.available() == pool.num_slots, "a state slot was not given back"
    return outs


def test_hybrid_decode_graphs_match_eager(checkpoint, monkeypatch, caplog):
    from engine.llm import LLM

    with LLM(**_kw(checkpoint)) as llm:
        assert llm.runner.graph_runner is None
        want = _rounds(llm)
    _pretend_recorded_graphs(monkeypatch)
    _Graph.replays = 0
    with caplog.at_level(logging.INFO), LLM(**_kw(checkpoint)) as llm:
        gr = llm.runner.graph_runner
        assert gr is not None and gr.buckets == [1, 2, 4], caplog.text
        assert llm.runner.piecewise_runner is None
        assert "decode graphs: a replay matches an eager step" in caplog.text
        assert "piecewise graphs are off for" in caplog.text
        before = _Graph.replays
        got = _rounds(llm)
        assert _Graph.replays > before + 10    # the decode steps replayed
    assert "graph capture failed" not in caplog.text
    assert [t for t, _ in got] == [t for t, _ in want]
    for g_, w in zip(got, want):
        assert g_[1] == pytest.approx(w[1], abs=1e-4)   # the chosen tokens' log-probs


def test_padding_rows_write_only_the_scratch_slot(checkpoint, monkeypatch):
    """A replay of a 1-row batch in the 4-row bucket: the request's slot advances, every
    other slot but the scratch slot 0 keeps its states."""
    from engine.executor.schedule_batch import ScheduleBatch
    from engine.forward_batch import ForwardMode
    from engine.llm import LLM

    _pretend_recorded_graphs(monkeypatch)
    monkeypatch.setenv("FERRY_SKIP_GRAPH_CHECK", "1")
    with LLM(**_kw(checkpoint)) as llm:
        r = llm.runner
        gr, pool = r.graph_runner, r.state_pool
        assert gr is not None
        for t in (*pool.conv_states, *pool.recurrent_states):
            t.normal_()
        keep = [t.clone() for t in (*pool.conv_states, *pool.recurrent_states)]

        class _Req:
            req_pool_idx, state_slot = 1, 2

            def token_at(self, pos):
                return 7

        page = r.kv_pool.page_size
        batch = ScheduleBatch(mode=ForwardMode.DECODE, reqs=[_Req()], prefix_lens=[3],
                              extend_lens=[1], sample=[True], out_cache_loc=[page + 3])
        gr.replay(batch)
        for old, new in zip(keep, (*pool.conv_states, *pool.recurrent_states)):
            assert not torch.equal(old[2], new[2])            # the request's slot advanced
            assert torch.equal(old[1], new[1]) and torch.equal(old[3], new[3])


@pytest.mark.parametrize("steps", [1, 2])
def test_mtp_verify_steps_replay_verify_graphs(tmp_path, monkeypatch, caplog, steps):
    """MTP on a hybrid model with graphs on: the verify steps (``verify_n`` = 1 + drafts
    rows a request, the linear layers writing each row's state to the scratch slots)
    replay the verify graphs captured for them, the commit picks the state after the last
    accepted row, and the output is that of the model alone (greedy): random drafts with one
    draft token, oracle drafts (accepted) with two."""
    from mtp_helpers import add_qwen_mtp
    from qwen3_next_helpers import save_tiny

    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    save_tiny("qwen3_next", tmp_path)
    add_qwen_mtp(tmp_path, 3, oracle=steps == 2)   # oracle drafts: commits of every count
    prompts = [[5, 9, 14, 3, 77, 120, 31], list(range(40, 80)), [200, 201, 7]]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", max_total_tokens=2048, chunked_prefill_size=16,
              max_running_requests=3, cuda_graph_max_bs=9)
    with LLM(str(tmp_path), **kw) as llm:
        want = [o.token_ids for o in llm.generate(prompts, sp)]
    _pretend_recorded_graphs(monkeypatch)
    with caplog.at_level(logging.INFO), LLM(str(tmp_path), speculative_algorithm="MTP",
                                            speculative_num_steps=steps, **kw) as llm:
        r = llm.runner
        assert r.graph_runner is not None, caplog.text
        seen = []
        replay = r.graph_runner.replay
        r.graph_runner.replay = lambda b, *a, **k: (seen.append(b.verify_n),
                                                    replay(b, *a, **k))[1]
        # up to the 3 running requests (9 rows at most: 3 of 3 rows)
        assert r.graph_runner.verify_buckets == [1, 2, 3]
        got = [o.token_ids for o in llm.generate(prompts, sp)]
        st = llm.scheduler.stats
        assert st["spec_verify_reqs"] > 0
        if steps == 2:   # rows 2 and 3 of a request were kept: commits from later rows
            assert st["spec_accept_lengths"][1] + st["spec_accept_lengths"][2] > 0, st
    assert f"verify graphs ({steps + 1} rows a request" in caplog.text
    assert "verify graphs: a replay matches an eager step" in caplog.text
    assert seen.count(steps + 1) >= 2, seen   # verify steps replayed their graphs
    assert got == want
