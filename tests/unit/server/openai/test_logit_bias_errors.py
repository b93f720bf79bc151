"""The ``logit_bias`` errors name every bad key: out-of-vocabulary ids with the vocabulary size
(``validate_request`` and the HTTP 400), and keys or values of the wrong shape (the request
model), each against a hand-written message."""

from __future__ import annotations

import pytest
from app_helpers import make_app
from starlette.testclient import TestClient

from engine.sampling.params import SamplingParams
from engine.validation import RequestError, validate_request
from server.http.errors import APIError
from server.openai.protocol import CompletionRequest, parse_request


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
