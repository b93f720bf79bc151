"""``engine.device``'s XPU branches on the CPU, against a stand-in for torch's XPU module
(memory figures, the graph policy and the capture fallback, dtype, distributed backend and
teardown), plus the replay-vs-eager decision of the start-up graph check. No XPU needed."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from engine import device as dev
from engine.device import graphs as dgraphs

GiB = 1 << 30


class FakeXPU(types.SimpleNamespace):
    """What ``engine.device`` calls of torch's XPU module, with its calls recorded."""

    def __init__(self, *, total=24 * GiB, driver_free=None, reserved=10 * GiB, name="Intel(R) "
                 "Arc(TM) B580 Graphics", graph=True, mem_get_info_raises=False):
        super().__init__(calls=[])
        self._total, self._reserved, self._name = total, reserved, name
        # BMG/PVC: the driver's free figure does not drop after torch allocates
        self._driver_free = total - 1 * GiB if driver_free is None else driver_free
        self._raises = mem_get_info_raises
        if graph:
            self.XPUGraph = type("XPUGraph", (), {})

    def is_available(self):
        return True

    def get_device_properties(self, *a):
        return types.SimpleNamespace(total_memory=self._total, gpu_subslice_count=20,
                                     max_compute_units=160, name=self._name)

    def mem_get_info(self, *a):
        if self._raises:
            raise RuntimeError("The device (Intel(R) Arc(TM) Graphics) doesn't support "
                               "querying the available free memory.")
        return self._driver_free, self._total

    def memory_reserved(self, *a):
        return self._reserved

    def memory_allocated(self, *a):
        return self._reserved - GiB

    def get_device_name(self, *a):
        return self._name

    def synchronize(self, *a):
        self.calls.append("synchronize")

    def empty_cache(self):
        self.calls.append("empty_cache")


class _Stream:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def wait_stream(self, other):
        self.calls.append(f"{self.name} waits for {other.name}")


def test_stream_context_orders_the_side_stream_both_ways(fake_xpu):
    """The side stream waits for the current one before the block (a capture's warm-up
    must see its buffers' fills) and the current one for the side stream after it."""
    import contextlib

    fake = fake_xpu()
    main = _Stream("main", fake.calls)
    fake.current_stream = lambda *a: main

    @contextlib.contextmanager
    def stream(s):
        fake.calls.append(f"on {s.name}")
        yield
        fake.calls.append(f"off {s.name}")

    fake.stream = stream
    side = _Stream("side", fake.calls)
    with dev.stream_context("xpu", side):
        fake.calls.append("work")
    assert fake.calls == ["side waits for main", "on side", "work", "off side",
                          "main waits for side"]
    with dev.stream_context("cpu", side):   # the CPU: nothing
        pass
    assert len(fake.calls) == 5
    with pytest.raises(RuntimeError), dev.stream_context("xpu", side):
        raise RuntimeError("a warm-up failed")
    assert fake.calls[-1] == "main waits for side"   # ordered even when the block raised


@pytest.fixture
def fake_xpu(monkeypatch):
    def install(**kw):
        fake = FakeXPU(**kw)
        monkeypatch.setattr(torch, "xpu", fake)
        return fake
    return install


# ---- memory figures ----------------------------------------------------------------------

def test_free_memory_counts_what_torch_reserved(fake_xpu):
    """A stuck driver figure: free is what torch has not reserved, less the allowance for
    memory outside torch (Level Zero context, kernels, oneCCL) that nothing reports."""
    fake_xpu(driver_free=23 * GiB, reserved=10 * GiB)  # the driver's figure did not drop
    m = dev.memory_info("xpu")
    assert dev.XPU_UNTRACKED_RESERVE == GiB
    assert (m.free, m.total, m.allocated) == (13 * GiB, 24 * GiB, 9 * GiB)


def test_free_memory_takes_the_driver_figure_when_lower(fake_xpu):
    fake_xpu(driver_free=5 * GiB, reserved=10 * GiB)  # another process holds memory too
    assert dev.memory_info("xpu").free == 5 * GiB


def test_free_memory_without_mem_get_info(fake_xpu):
    fake_xpu(mem_get_info_raises=True, reserved=3 * GiB)  # older integrated GPUs
    m = dev.memory_info("xpu")
    assert (m.free, m.total) == (20 * GiB, 24 * GiB)


def test_a_working_driver_figure_needs_no_allowance(fake_xpu):
    """A driver figure below total - reserved sees torch's memory, hence the rest too."""
    fake_xpu(driver_free=12 * GiB, reserved=10 * GiB)  # 2 GiB outside torch, counted
    assert dev.memory_info("xpu").free == 12 * GiB


def test_kv_budget_leaves_out_the_weights(fake_xpu):
    """The runner's KV budget (``total * fraction - used``) with the stuck driver figure
    would have counted the 10 GiB of weights as free."""
    fake_xpu(driver_free=24 * GiB, reserved=10 * GiB)
    m = dev.memory_info("xpu")
    assert m.total * 0.85 - (m.total - m.free) == pytest.approx(24 * GiB * 0.85 - 11 * GiB)


# ---- device facts ------------------------------------------------------------------------

def test_xpu_backend_name_units_and_fp8(fake_xpu):
    fake_xpu()
    assert dev.resolve_device("xpu") == "xpu"
    assert dev.dist_backend("xpu") == "xccl"
    assert dev.multiprocessor_count("xpu") == 20        # Xe cores, not EUs
    assert dev.triton_fp8_e4m3("xpu") is True           # triton-xpu: allow_fp8e4nv
    assert dev.triton_fp8_e4m3("cpu") is False
    assert dev.use_triton("xpu") and dev.default_attention_backend("xpu") == "triton"


def test_bf16_default_except_on_the_a770(fake_xpu, caplog):
    fake_xpu()
    assert dev.resolve_dtype("auto", "xpu") is torch.bfloat16
    fake_xpu(name="Intel(R) Arc(TM) A770 Graphics")
    with caplog.at_level(logging.WARNING, logger="engine.device"):
        assert dev.resolve_dtype("auto", "xpu") is torch.float16
    assert "A770" in caplog.text and "--dtype bfloat16" in caplog.text
    assert dev.resolve_dtype("bfloat16", "xpu") is torch.bfloat16  # asked for: kept


def test_teardown_policy():
    assert dev.teardown_group_at_exit("xccl") and dev.teardown_group_at_exit("gloo")
    assert not dev.teardown_group_at_exit("nccl")
    assert dev.worker_teardown_at_exit("xpu")
    assert not dev.worker_teardown_at_exit("cuda") and not dev.worker_teardown_at_exit("cpu")


def test_release_memory_syncs_and_empties_the_cache(fake_xpu):
    fake = fake_xpu()
    dev.release_memory("xpu")
    assert fake.calls == ["synchronize", "empty_cache"]
    dev.release_memory("cpu")  # nothing to release


def test_destroy_tp_tears_xccl_down_but_leaves_nccl(monkeypatch):
    from engine import distributed as tpd

    destroyed = []
    monkeypatch.setattr(tpd.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(tpd.dist, "destroy_process_group", lambda: destroyed.append(1))
    for backend, want in (("xccl", 1), ("nccl", 0), ("gloo", 1)):
        destroyed.clear()
        monkeypatch.setattr(tpd, "_TP", tpd.TPGroup(2, 0, backend))
        tpd.destroy_tp(timeout=5.0)
        assert len(destroyed) == want, backend
        assert tpd.get_tp().size == 1


def test_host_to_device_on_the_cpu_is_the_tensor():
    t = torch.arange(5)
    assert dev.host_to_device(t, torch.device("cpu")) is t


# ---- graphs: when, and the fallback ------------------------------------------------------

@pytest.mark.parametrize("version", ["2.13.0+xpu", "2.14.0+xpu", "2.15.0+xpu"])
def test_xpu_graphs_are_opt_in_on_every_torch(version, fake_xpu, monkeypatch):
    """Opt-in at torch 2.14 too: its Level Zero graphs rest on an open upstream change
    (vllm#51600), not on a run on Intel hardware (they were on by default from 2.14)."""
    fake = fake_xpu()
    monkeypatch.setattr(torch, "__version__", version)
    on, why = dev.graphs_enabled("xpu")
    assert not on and "--enable-xpu-graph" in why
    assert dgraphs.XPU_GRAPHS_BY_DEFAULT is False
    assert dev.graphs_enabled("xpu", enable_xpu=True) == (True, "")
    assert dev.graphs_enabled("xpu", enable_xpu=True, disable=True)[0] is False
    assert dev.graph_class("xpu") is fake.XPUGraph


def test_no_xpu_graph_class_means_no_graphs(fake_xpu):
    fake_xpu(graph=False)  # torch < 2.11
    assert dev.graph_class("xpu") is None
    on, why = dev.graphs_enabled("xpu", enable_xpu=True)
    assert not on and "no graph class" in why


def test_cuda_and_cpu_graph_policy_unchanged():
    assert dev.graphs_enabled("cuda") == (True, "")   # CUDAGraph exists in every build
    assert dev.graphs_enabled("cuda", disable=True)[0] is False
    assert dev.graphs_enabled("cpu")[0] is False
    assert dev.graphs_capture_collectives("cuda") and not dev.graphs_capture_collectives("xpu")
    assert dev.coarse_graph_buckets("xpu") and not dev.coarse_graph_buckets("cuda")


def test_capture_failure_falls_back_with_its_reason(fake_xpu, caplog):
    fake = fake_xpu()

    def capture():
        raise RuntimeError("UR_RESULT_ERROR_INVALID_OPERATION\nmore lines")

    with caplog.at_level(logging.WARNING):
        assert dev.capture_or_eager("xpu", "decode graphs", capture) is None
    assert "decode graphs: graph capture failed on xpu (RuntimeError: " \
           "UR_RESULT_ERROR_INVALID_OPERATION); these steps run eagerly" in caplog.text
    assert fake.calls == ["synchronize", "empty_cache"]  # the device recovered
    assert dev.capture_or_eager("xpu", "decode graphs", lambda: "runner") == "runner"


def test_capture_failure_on_a_device_that_stays_broken(fake_xpu, caplog):
    fake = fake_xpu()
    fake.synchronize = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
    with caplog.at_level(logging.WARNING):
        assert dev.capture_or_eager("xpu", "piecewise graphs", lambda: 1 / 0) is None
    assert "ZeroDivisionError" in caplog.text and "device lost" in caplog.text


# ---- the replay-vs-eager decision --------------------------------------------------------

def _logits(seed=0, rows=3, vocab=500):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("dtype,noise,ok", [
    (torch.float32, 0.0, True), (torch.float32, 1e-5, True), (torch.float32, 1e-1, False),
    (torch.bfloat16, 3e-2, True), (torch.bfloat16, 2.0, False)])
def test_replay_tolerance(dtype, noise, ok):
    e = _logits()
    r = e + noise * torch.randn(e.shape, generator=torch.Generator().manual_seed(1))
    got, detail = dev.replay_matches_eager(r, e, dtype)
    assert got is ok, detail
    assert "max |replay - eager|" in detail


def test_replay_garbage_and_stale_outputs_disagree():
    e = _logits()
    assert not dev.replay_matches_eager(_logits(seed=7), e, torch.bfloat16)[0]   # garbage
    assert not dev.replay_matches_eager(torch.zeros_like(e), e, torch.bfloat16)[0]
    assert not dev.replay_matches_eager(e[:2], e, torch.float32)[0]               # shape


def test_replay_non_finite_pattern_must_match():
    e = _logits()
    r = e.clone()
    r[1, 3] = float("nan")
    ok, detail = dev.replay_matches_eager(r, e, torch.bfloat16)
    assert not ok and "non-finite" in detail
    e[1, 3] = r[1, 3] = float("-inf")  # masked the same way in both: fine
    assert dev.replay_matches_eager(r, e, torch.bfloat16)[0]


def test_replay_argmax_must_stay_near_the_top():
    """Within the 16-bit tolerance, yet the eager step's best token is not among the
    replay's top 5: a structured error (one row's attention wrong), not rounding."""
    e = torch.zeros(1, 100)
    e[0, :20] = 0.9
    e[0, 7] = 1.0
    r = e.clone()
    r[0, 7] = 0.92
    r[0, 10:16] = 0.97
    ok, detail = dev.replay_matches_eager(r, e, torch.bfloat16)
    assert not ok and "top 5" in detail
