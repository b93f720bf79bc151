"""The prefill rows' cumulative counts the Gated DeltaNet layers hand FLA's kernels: built once
a step (``forward_batch_builder._state_view``: the device tensor, a view of the step's upload,
and its CPU twin), the same two objects in every layer (FLA caches its chunk indices by
tensor identity), the CPU twin passed only where fla-core's function takes it; the torch
reference keeps host ints."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.executor.forward_batch_builder import _state_view
from engine.forward_batch import ForwardMode
from engine.layers import gated_deltanet as gdn
from kernels.linear_attention import fla_ops


def _view(device: str, num_decodes: int, mode=ForwardMode.EXTEND):
    pools = SimpleNamespace(state_pool=SimpleNamespace(conv_states=[], recurrent_states=[],
                                                       scratch_base=5),
                            device=torch.device(device))
    batch = SimpleNamespace(mode=mode, batch_size=3, num_decodes=num_decodes, verify_n=0)
    cu = [0, 5, 12, 13]
    on_device = [torch.tensor([1, 2, 3]), torch.tensor(cu)]
    return _state_view(pools, batch, [[1, 2, 3], cu], on_device), on_device


def test_state_view_builds_the_prefill_counts_once():
    view, on_device = _view("cuda", num_decodes=0)
    cu, twin = view.prefill_cu
    assert cu is on_device[1] and twin.tolist() == [0, 5, 12, 13] and twin.device.type == "cpu"
    view, on_device = _view("cuda", num_decodes=1)   # a mixed step: the decode tail cut off
    cu, twin = view.prefill_cu
    assert cu.tolist() == [0, 5, 12] and twin.tolist() == [0, 5, 12]
    assert _view("cpu", 0)[0].prefill_cu is None      # the torch reference: host ints
    assert _view("cuda", 0, ForwardMode.DECODE)[0].prefill_cu is None


def test_layers_pass_the_same_objects(monkeypatch):
    view, _ = _view("cuda", num_decodes=1)
    state = gdn.LinearStateBatch(None, None, view.slots, view.cu_seqlens, False, 1,
                                 view.cu_seqlens_dev, prefill_cu=view.prefill_cu)
    monkeypatch.setattr(gdn, "gated_delta_rule_backend", lambda device: "fla")
    a = gdn.GatedDeltaNet._prefill_cu(state, 2, torch.device("cuda"))
    b = gdn.GatedDeltaNet._prefill_cu(state, 2, torch.device("cuda"))
    assert a[0] is b[0] and a[1] is b[1] and a == view.prefill_cu
    monkeypatch.setattr(gdn, "gated_delta_rule_backend", lambda device: "torch")
    assert gdn.GatedDeltaNet._prefill_cu(state, 2, torch.device("cpu")) == ([0, 5, 12], None)


def test_cpu_twin_only_where_fla_takes_it():
    def new(x, cu_seqlens=None, cu_seqlens_cpu=None):
        pass

    def old(x, cu_seqlens=None):
        pass

    twin = torch.tensor([0, 3])
    assert fla_ops._twin(new, twin) == {"cu_seqlens_cpu": twin}
    assert fla_ops._twin(old, twin) == {}
    assert fla_ops._twin(new, None) == {}
