"""``--speculative-algorithm MTP`` (``NEXTN``) at start-up (engine/executor/preflight.py,
engine/models/mtp.py): the alias, a family without MTP layers refused in one line, a
DeepSeek-V3 shape with dummy weights accepted, EAGLE-3 refused for MLA."""

from __future__ import annotations

import os

import pytest

import engine
from engine.args import ServerArgs
from engine.executor.preflight import check_start_up


def _config(name: str) -> str:
    return os.path.join(os.path.dirname(engine.__file__), "configs", f"{name}.json")


def test_nextn_is_mtp_and_needs_no_draft_path():
    args = ServerArgs(model_path="/m", speculative_algorithm="NEXTN", speculative_num_steps=2)
    assert args.speculative_algorithm == "MTP"
    with pytest.raises(ValueError, match="--speculative-eagle-topk above 1"):
        ServerArgs(model_path="/m", speculative_algorithm="MTP", speculative_eagle_topk=2)


@pytest.mark.parametrize("name", ["moonlight-16b-a3b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
def test_shapes_with_a_dummy_mtp_layer_pass_the_start_up_checks(name):
    """An MLA model and the hybrid ones (whose configs declare ``mtp_num_hidden_layers``)."""
    check_start_up(ServerArgs(model_path=_config(name), load_format="dummy",
                              device="cpu", speculative_algorithm="MTP"))


@pytest.mark.parametrize("name,algo,what", [
    ("deepseek-v2-lite", "MTP", "DeepseekV2ForCausalLM has no multi-token-prediction layer"),
    ("llama-tiny", "NEXTN", "LlamaForCausalLM has no multi-token-prediction layer"),
    ("moonlight-16b-a3b", "EAGLE3",
     "DeepseekV3ForCausalLM (multi-head latent attention) does not support "
     "--speculative-algorithm EAGLE3"),
])
def test_refusals_are_one_line(name, algo, what):
    extra = {"speculative_draft_model_path": "/no/draft"} if algo == "EAGLE3" else {}
    args = ServerArgs(model_path=_config(name), load_format="dummy", device="cpu",
                      speculative_algorithm=algo, **extra)
    with pytest.raises(ValueError) as e:
        check_start_up(args)
    assert what in str(e.value) and "\n" not in str(e.value)
