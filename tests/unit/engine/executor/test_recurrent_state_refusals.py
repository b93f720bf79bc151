"""engine/executor/preflight.py: a model with linear-attention (RECURRENT_STATE) layers is
refused, in one line naming the class and the flag, with EAGLE-3 and STANDALONE speculation
and LoRA; a model without them, the CPU path, device graphs on a GPU (decode graphs capture
the linear layers; prefill runs eagerly), NGRAM, EAGLE and MTP speculation (the verify step
rolls the states back) and TP > 1 (the linear layers split their heads:
tests/engine/test_tensor_parallel_hybrid_mla.py) pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.args import ServerArgs
from engine.executor.preflight import check_recurrent_state_flags
from engine.layer_spec import AttentionKind, CacheKind, LayerSpec, RecurrentStateSpec

FULL = LayerSpec(head_dim=16, v_head_dim=16, num_kv_heads=2)
LINEAR = LayerSpec(attention=AttentionKind.LINEAR, cache=CacheKind.RECURRENT_STATE,
                   head_dim=8, v_head_dim=8, num_kv_heads=2,
                   state=RecurrentStateSpec(48, 4, 4, 8, 8))


class HybridLM:
    def __init__(self, specs):
        self._specs = specs

    def layer_specs(self):
        return self._specs


def _args(**kw):
    return ServerArgs(model_path="/m", **kw)


def test_hybrid_on_cpu_and_plain_models_pass():
    check_recurrent_state_flags(HybridLM([LINEAR, FULL]), _args(), "cpu")
    check_recurrent_state_flags(HybridLM([FULL]), _args(tp_size=2), "cuda")
    check_recurrent_state_flags(HybridLM([LINEAR, FULL]), _args(tp_size=2), "cpu")
    check_recurrent_state_flags(HybridLM([LINEAR]), _args(disable_cuda_graph=True), "cuda")


def test_hybrid_with_device_graphs_passes():
    """Decode graphs capture the linear layers (the state slots are a device tensor): no
    --disable-cuda-graph needed on a GPU any more."""
    check_recurrent_state_flags(HybridLM([LINEAR, FULL]), _args(), "cuda")
    check_recurrent_state_flags(HybridLM([LINEAR, FULL]), _args(tp_size=2), "cuda")


@pytest.mark.parametrize("kw,device,flag", [
    ({"enable_lora": True}, "cpu", "LoRA"),
    ({"enable_lora": True}, "cuda", "LoRA"),
])
def test_hybrid_refusals_name_the_flag(kw, device, flag):
    with pytest.raises(ValueError) as e:
        check_recurrent_state_flags(HybridLM([LINEAR, FULL]), _args(**kw), device)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("HybridLM has linear-attention") and flag in msg


@pytest.mark.parametrize("algo", ["EAGLE3", "STANDALONE"])
def test_speculation_without_state_rollback_is_refused(algo):
    # the fields the check reads (a real ServerArgs needs the draft path too)
    args = SimpleNamespace(tp_size=1, speculative_algorithm=algo, lora_paths=None,
                           enable_lora=False, disable_cuda_graph=False)
    with pytest.raises(ValueError, match=f"--speculative-algorithm {algo}"):
        check_recurrent_state_flags(HybridLM([LINEAR]), args, "cpu")


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE", "MTP"])
def test_speculation_with_state_rollback_passes(algo):
    """The verify step commits each linear layer's state at the last accepted token."""
    args = SimpleNamespace(tp_size=1, speculative_algorithm=algo, lora_paths=None,
                           enable_lora=False, disable_cuda_graph=False)
    check_recurrent_state_flags(HybridLM([LINEAR]), args, "cpu")
