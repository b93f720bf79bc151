"""Every IPC message survives a msgpack round trip through the typed decoder of the socket
that receives it, and a decoder refuses messages that are not meant for it (no pickle)."""

from __future__ import annotations

import msgspec
import pytest

from engine import io_struct as io
from engine.ipc import DETOK_IN, ENGINE_IN, SERVER_IN
from engine.sampling.params import SamplingParams

SP = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, min_p=0.1, seed=-3,
                    stop=["\n\n", "😀"], stop_token_ids=[2], ignore_eos=True,
                    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                    logit_bias={5: -100.0, 17: 2.5}, logprobs=3, skip_special_tokens=False,
                    spaces_between_special_tokens=False)

ENGINE_MSGS = [
    io.TokenizedGenerateReq(rid="r1", input_ids=[1, 2, 3], sampling_params=SP, stream=True,
                            arrival_time=12.5),
    io.TokenizedGenerateReq(rid="r2", input_ids=[4], sampling_params=SamplingParams()),
    io.AbortReq(rid="r1"),
    io.GetServerInfoReq(rid="info-1"),
    io.TokenizedGenerateReq(rid="r3", input_ids=[5], sampling_params=SamplingParams(),
                            lora_name="sql"),
    io.LoadLoRAReq(rid="lora-1", lora_name="sql", lora_path="/adapters/sql"),
    io.UnloadLoRAReq(rid="lora-2", lora_name="sql"),
    io.TokenizedGenerateReq(rid="e1", input_ids=[5, 6], sampling_params=SamplingParams(
        max_tokens=1), pooling=True),
]
DETOK_MSGS = [
    io.BatchTokenIdOut(rids=["a", "b"], new_token_ids=[[1], []],
                       finished_reasons=[None, {"type": "stop", "matched": 2, "message": None}],
                       prompt_tokens=[3, 4], completion_tokens=[1, 9],
                       stop_strs=[["x"], []], skip_special_tokens=[True, False],
                       spaces_between_special_tokens=[True, True],
                       logprobs=[[[-0.5, [[1, -0.5], [7, -1.5]]]], None]),
]
SERVER_MSGS = [
    io.BatchStrOut(rids=["a"], texts=["hé😀"], new_token_ids=[[1, 2]],
                   finished_reasons=[{"type": "stop", "matched": "\n", "message": None}],
                   prompt_tokens=[3], completion_tokens=[2]),
    io.ReadyOut(rid="engine", max_total_tokens=16384, max_context_len=8192,
                max_running_requests=256, vocab_size=49152, device="cpu", dtype="float32",
                model="m"),
    io.ReadyOut(rid="detokenizer"),
    io.ReadyOut(rid="engine", lora_enabled=True, lora_adapters={"sql": "/adapters/sql"}),
    io.LoRAOut(rid="lora-1", success=False, message="no such adapter", status=404,
               param="lora_name", adapters={"a": "/x"}),
    io.ErrorOut(rid="r", message="bad", status=400, param="prompt",
                code="context_length_exceeded"),
    io.ServerInfoOut(rid="i", kv_used_tokens=1, kv_free_tokens=2, kv_total_tokens=3,
                     num_running=4, num_waiting=5, stats={"pid": 7}),
    io.StatsOut(num_running=1, num_waiting=2, kv_usage=0.25, prompt_tokens=3,
                generation_tokens=4),
    # float32 values (an embedding, a score) come back bit-exact
    io.PooledOut(rids=["e1", "s1"], outputs=[[0.1, -2.5e-8, 3.4028234663852886e38], [0.75]],
                 prompt_tokens=[2, 9], cached_tokens=[0, -1]),
    io.ReadyOut(rid="engine", pooling={"task": "embed", "pooling": "last", "normalize": True,
                                       "matryoshka": False, "matryoshka_dims": [],
                                       "num_labels": 1}),
]


@pytest.mark.parametrize("typ,msg", [(ENGINE_IN, m) for m in ENGINE_MSGS]
                         + [(DETOK_IN, m) for m in DETOK_MSGS]
                         + [(SERVER_IN, m) for m in SERVER_MSGS],
                         ids=lambda x: type(x).__name__ if isinstance(x, msgspec.Struct) else "")
def test_round_trip(typ, msg):
    data = msgspec.msgpack.encode(msg)
    back = msgspec.msgpack.Decoder(typ).decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert msgspec.structs.asdict(back) == msgspec.structs.asdict(msg)


@pytest.mark.parametrize("typ,msg", [(SERVER_IN, ENGINE_MSGS[2]), (ENGINE_IN, SERVER_MSGS[0]),
                                     (DETOK_IN, ENGINE_MSGS[0])])
def test_wrong_socket_is_refused(typ, msg):
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(typ).decode(msgspec.msgpack.encode(msg))


def test_garbage_is_refused():
    import pickle

    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        msgspec.msgpack.Decoder(SERVER_IN).decode(pickle.dumps(io.AbortReq(rid="x")))
