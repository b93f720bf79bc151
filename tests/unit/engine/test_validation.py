"""``validate_request``: the one set of request checks behind the server, the engine and LLM.

Expected values are hand-computed from the case (vocabulary 100, context 10 tokens), and the
messages are the ones the OpenAI API and the e2e tests use.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.sampling.params import SamplingParams
from engine.validation import RequestError, validate_request

VOCAB, CTX = 100, 10


def _err(ids, sp=None, **kw) -> RequestError:
    with pytest.raises(RequestError) as ei:
        validate_request(ids, sp or SamplingParams(max_tokens=1), VOCAB, CTX, **kw)
    assert isinstance(ei.value, ValueError)  # LLM users catch ValueError
    assert str(ei.value) == ei.value.message
    return ei.value


def test_empty_prompt():
    e = _err([])
    assert (e.message, e.param, e.code) == ("the prompt is empty", "prompt", None)
    assert _err([], param="messages").param == "messages"


def test_token_ids_must_be_in_the_vocabulary():
    assert validate_request([0, 99], SamplingParams(max_tokens=1), VOCAB, CTX) == 1
    e = _err([5, 100])                                   # id == vocab_size
    assert (e.message, e.param) == ("token id 100 is outside the vocabulary [0, 100)", "prompt")
    e = _err([-1, 3])
    assert e.message == "token id -1 is outside the vocabulary [0, 100)"
    # no vocabulary known (0 or None): ids are not checked
    assert validate_request([1000], SamplingParams(max_tokens=1), None, CTX) == 1


def test_context_boundary():
    # 6 + 4 == 10: exactly the context fits, and the budget is max_tokens
    assert validate_request([1] * 6, SamplingParams(max_tokens=4), VOCAB, CTX) == 4
    e = _err([1] * 6, SamplingParams(max_tokens=5))      # one past it
    assert e.code == "context_length_exceeded" and e.param == "max_tokens"
    assert e.message == ("This model's maximum context length is 10 tokens. However, you "
                         "requested 11 tokens (6 in the prompt, 5 for the completion). "
                         "Please reduce the prompt or the completion length.")
    # max_tokens None: up to the context; the prompt must leave room for one token
    assert validate_request([1] * 9, SamplingParams(max_tokens=None), VOCAB, CTX) == 1
    e = _err([1] * 10, SamplingParams(max_tokens=None))
    assert e.param == "prompt" and "requested 11 tokens (10 in the prompt, 1 for" in e.message
    # the prompt alone leaves no room: the prompt is at fault, whatever max_tokens says
    assert _err([1] * 10, SamplingParams(max_tokens=3)).param == "prompt"
    # a default max_tokens (not the client's): the prompt is at fault
    assert _err([1] * 6, SamplingParams(max_tokens=5), max_tokens_param=None).param == "prompt"
    assert _err([1] * 6, SamplingParams(max_tokens=5), param="messages",
                max_tokens_param="max_completion_tokens").param == "max_completion_tokens"


def test_min_tokens_within_the_context():
    sp = SamplingParams(max_tokens=None, min_tokens=4)
    assert validate_request([1] * 6, sp, VOCAB, CTX) == 4
    e = _err([1] * 6, SamplingParams(max_tokens=None, min_tokens=5))
    assert (e.param, e.code) == ("min_tokens", "context_length_exceeded")
    assert "requested 11 tokens (6 in the prompt, 5 as min_tokens)" in e.message


def test_clamp_max_tokens_is_the_offline_rule():
    sp = SamplingParams(max_tokens=16)
    assert validate_request([1] * 6, sp, VOCAB, CTX, clamp_max_tokens=True) == 4   # 10 - 6
    assert validate_request([1] * 6, SamplingParams(max_tokens=3), VOCAB, CTX,
                            clamp_max_tokens=True) == 3
    e = _err([1] * 10, sp, clamp_max_tokens=True)         # no room for even one token
    assert e.param == "prompt" and e.code == "context_length_exceeded"


def test_sampling_bounds_keep_their_param():
    e = _err([1], SamplingParams(temperature=3.0))
    assert (e.message, e.param, e.code) == ("temperature must be in [0, 2], got 3.0",
                                            "temperature", None)
    assert _err([1], SamplingParams(top_k=VOCAB + 1)).param == "top_k"
    assert _err([1], SamplingParams(stop_token_ids=[VOCAB])).param == "stop_token_ids"
    assert _err([1], SamplingParams(max_tokens=0)).param == "max_tokens"


def test_load_engine_tokenizer_rule(tmp_path):
    """Dummy weights without tokenizer files: None; a real model without one: an error."""
    import json

    from engine.args import ServerArgs
    from engine.scheduler.build import load_engine_tokenizer

    # a vocabulary too small for the embedded fallback tokenizer, so none can be found
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "vocab_size": 1000}))
    assert load_engine_tokenizer(ServerArgs(model_path=str(tmp_path),
                                            load_format="dummy")) is None
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_engine_tokenizer(ServerArgs(model_path=str(tmp_path), load_format="safetensors"))


# ---- the engine, the server and LLM give the same answer for the same bad request ----------

@pytest.fixture(scope="module")
def tiny():
    """LLM and an engine process's loop on the dummy llama-tiny (vocab 49152, context 64)."""
    from engine import LLM
    from engine.loader.loader import config_dir
    from engine.scheduler.engine_loop import EngineLoop

    kw = dict(load_format="dummy", device="cpu", dtype="float32", max_total_tokens=64,
              max_running_requests=4)
    llm = LLM(model_path=config_dir("llama-tiny"), **kw)
    loop = EngineLoop(llm.args, ipc=None)
    loop._start()  # build_engine, as in the engine process (no warm-up on the CPU)
    assert llm.runner.max_context_len == loop.runner.max_context_len == 64
    assert llm.vocab_size == loop.vocab_size == 49152
    return llm, loop


BAD = [  # (prompt ids, max_tokens, param, hand-written message)
    ([], None, "prompt", "the prompt is empty"),
    ([5, 49152], None, "prompt", "token id 49152 is outside the vocabulary [0, 49152)"),
    ([-1], None, "prompt", "token id -1 is outside the vocabulary [0, 49152)"),
    ([1] * 64, None, "prompt",
     "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
     "(64 in the prompt, 1 for the completion). Please reduce the prompt or the completion "
     "length."),
]


@pytest.mark.parametrize("ids,max_tokens,param,message", BAD)
def test_engine_server_and_llm_agree(tiny, ids, max_tokens, param, message):
    from engine import io_struct as io
    from server.http.errors import APIError
    from server.tokenizer_manager import TokenizerManager

    llm, loop = tiny
    sp = SamplingParams(max_tokens=max_tokens)
    # the engine process: an ErrorOut to the server
    out = loop.validate(io.TokenizedGenerateReq(rid="r", input_ids=ids, sampling_params=sp,
                                                stream=False))
    assert isinstance(out, io.ErrorOut)
    assert (out.message, out.param, out.status) == (message, param, 400)
    # the server: an OpenAI 400 (limits from the engine's ReadyOut)
    tm = SimpleNamespace(vocab_size=loop.vocab_size, max_context_len=loop.runner.max_context_len,
                         check_image_tokens=lambda ids, images, param: None)  # text-only
    with pytest.raises(APIError) as ei:
        TokenizerManager.check_prompt(tm, ids, max_tokens, "prompt",
                                      max_tokens_param="max_tokens")
    assert (ei.value.message, ei.value.param, ei.value.status) == (message, param, 400)
    assert ei.value.code == out.code
    # LLM.generate: a ValueError
    with pytest.raises(ValueError) as ei:
        llm.generate([ids], sp)
    assert str(ei.value) == message and ei.value.param == param


def test_engine_budget_and_llm_clamp(tiny):
    from engine import io_struct as io

    llm, loop = tiny
    req = io.TokenizedGenerateReq(rid="ok", input_ids=[1] * 60, stream=False,
                                  sampling_params=SamplingParams(max_tokens=None))
    assert loop.validate(req) == 4                        # 64 - 60: up to the context
    req.sampling_params = SamplingParams(max_tokens=5)    # 65 > 64: the engine refuses
    out = loop.validate(req)
    assert out.code == "context_length_exceeded" and out.param == "max_tokens"
    # LLM cuts max_tokens to the room instead (finish_reason "length" after 4 tokens)
    res = llm.generate([[1] * 60], SamplingParams(max_tokens=5, temperature=0,
                                                  ignore_eos=True))
    assert len(res[0].token_ids) == 4 and res[0].finish_reason == "length"
    # a bad prompt among good ones: nothing is queued
    with pytest.raises(ValueError):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2))
    assert not llm.scheduler.has_work()
