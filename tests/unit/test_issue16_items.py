"""Issue 16's smaller items, each against a hand-written value: /metrics reads the engine's
running count now (not the last periodic report), the logit_bias 400 names every bad key and
the vocabulary size, the bench/parity subcommands list their own flags (with help) and not
the HTTP server's, and parallel_tool_calls is implemented (not an accepted no-op)."""

from __future__ import annotations

import re

import pytest
from app_helpers import make_app
from starlette.testclient import TestClient

from engine import io_struct as io
from engine.sampling.params import SamplingParams
from engine.validation import RequestError, validate_request
from server.cli import main
from server.http.errors import APIError
from server.openai.protocol import (
    ACCEPTED_NOOPS,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)


def gauge(text: str, name: str) -> float:
    m = re.search(rf'^ferry:{name}{{model_name="fake"}} (\S+)$', text, re.M)
    return float(m.group(1))


# ---- /metrics -----------------------------------------------------------------------------

def test_metrics_read_the_engines_current_counts():
    app, eng = make_app()
    client = TestClient(app)
    # the last periodic report said 3 running, 2 waiting; since then they finished
    eng.tm._dispatch(io.StatsOut(num_running=3, num_waiting=2, kv_usage=0.5))
    eng.num_running = 0
    text = client.get("/metrics").text
    assert gauge(text, "num_requests_running") == 0
    assert gauge(text, "num_requests_waiting") == 0
    eng.num_running = 2
    assert gauge(client.get("/metrics").text, "num_requests_running") == 2


def test_metrics_keep_the_last_values_when_the_engine_is_busy():
    app, eng = make_app()
    eng.mute_info = True  # the engine is inside a long step: no answer within 1 s
    eng.tm._dispatch(io.StatsOut(num_running=4, num_waiting=1, kv_usage=0.5))
    r = TestClient(app).get("/metrics")
    assert r.status_code == 200 and gauge(r.text, "num_requests_running") == 4
    assert eng.tm.router.info_waiters == {}


# ---- logit_bias ---------------------------------------------------------------------------

def test_logit_bias_vocab_error_names_every_bad_key():
    sp = SamplingParams(logit_bias={49152: 1.0, 5: 0.0, 70000: -1.0, 49151: 2.0})
    with pytest.raises(RequestError) as ei:
        validate_request([1, 2], sp, 49152, 2048)
    assert ei.value.param == "logit_bias"
    assert ei.value.message == ("logit_bias: token ids 49152, 70000 are outside the "
                                "vocabulary (vocabulary size 49152: ids 0 to 49151)")
    with pytest.raises(RequestError) as ei:
        validate_request([1], SamplingParams(logit_bias={100: 1.0}), 100, 2048)
    assert ei.value.message == ("logit_bias: token id 100 is outside the vocabulary "
                                "(vocabulary size 100: ids 0 to 99)")


def test_logit_bias_http_400_names_every_bad_key():
    client = TestClient(make_app()[0])
    r = client.post("/v1/completions", json={"prompt": [1], "logit_bias": {
        "50000": 1, "3": 1, "49152": -2}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "logit_bias"
    assert err["message"] == ("logit_bias: token ids 49152, 50000 are outside the vocabulary "
                              "(vocabulary size 49152: ids 0 to 49151)")


def test_logit_bias_shape_errors_name_every_bad_key():
    with pytest.raises(APIError) as ei:
        parse_request(CompletionRequest, {"prompt": "x", "logit_bias": {
            "-1": 1, "x": 2, "5": 200, "7": 1, "3000000000": 1, "9": "a"}})
    assert ei.value.param == "logit_bias"
    assert ei.value.message == (
        "logit_bias: keys 'x' are not token ids (strings of ASCII digits); token ids -1, "
        "3000000000 are out of range [0, 2**31); the values of 5, 9 are not numbers in "
        "[-100, 100]")


# ---- CLI help -----------------------------------------------------------------------------

@pytest.mark.parametrize("cmd,own", [
    ("bench-latency", {"--batch-size": "requests in the static batch",
                       "--no-warmup": "time the first run"}),
    ("bench-offline", {"--num-prompts": "requests to run", "--bench-seed": "seed"}),
    ("parity", {"--devices": "two devices", "--prompt-len": "tokens per random prompt"}),
])
def test_subcommand_help_lists_its_own_flags_not_the_servers(capsys, cmd, own):
    with pytest.raises(SystemExit) as ei:
        main([cmd, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ferry {cmd}")
    for flag, words in own.items():
        assert re.search(rf"{flag}\b.*\n?.*{words}", out), (flag, out)
    assert "--model-path" in out and "--device" in out  # the engine's flags stay
    for flag in ("--port", "--host", "--api-key", "--allowed-origins", "--max-request-bytes",
                 "--header-timeout", "--log-requests"):
        assert flag not in out, flag


def test_serve_help_keeps_the_server_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--port" in out and "--allowed-origins" in out and "--api-key" in out


def test_serve_refuses_a_malformed_origin(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["serve", "--allowed-origins", "localhost:3000"])
    assert ei.value.code == 2
    assert "--allowed-origins: 'localhost:3000' is not an origin" in capsys.readouterr().err


# ---- parallel_tool_calls ------------------------------------------------------------------

def test_parallel_tool_calls_is_implemented_not_a_noop():
    assert "parallel_tool_calls" not in ACCEPTED_NOOPS
    chat = {"messages": [{"role": "user", "content": "x"}]}
    req = parse_request(ChatCompletionRequest, dict(chat, parallel_tool_calls=False))
    assert req.model_extra["parallel_tool_calls"] is False
    with pytest.raises(APIError) as ei:  # completions has no tools
        parse_request(CompletionRequest, {"prompt": "x", "parallel_tool_calls": True})
    assert ei.value.param == "parallel_tool_calls" and ei.value.status == 400
