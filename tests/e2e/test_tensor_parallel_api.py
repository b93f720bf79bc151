"""The API against a tensor-parallel CPU server: the embedded SmolLM2 split over 3 ranks (its 9
query and 3 KV heads divide by 3; gloo), compared with the single-rank shared server.

Both run the same fp32 weights, so greedy outputs must be the same text and log-probabilities
must agree to float rounding; seeded sampling must draw the same tokens (rank 0 samples from
the gathered logits).
"""

from __future__ import annotations

import json

import httpx

SERVER_ARGS = ["--tp-size", "3", "--max-total-tokens", "8192"]

CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 20, "temperature": 0}


def _post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=srv.http_timeout)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_info_reports_every_rank(server, shared_server):
    tp = httpx.get(server.url + "/server_info", timeout=30).json()["tensor_parallel"]
    one = httpx.get(shared_server.url + "/server_info", timeout=30).json()["tensor_parallel"]
    assert tp["tp_size"] == 3 and tp["backend"] == "gloo"
    assert [r["rank"] for r in tp["ranks"]] == [0, 1, 2]
    assert one["tp_size"] == 1
    # each rank holds a third of the weights (all of them are split: layers and vocabulary),
    # except that one rank also keeps the tied LM head in the GGUF's Q8_0 blocks (49152 x 576
    # weights, 34 bytes per block of 32), which a tensor-parallel rank reads from its shard of
    # the dequantized embedding instead
    full = one["ranks"][0]["weight_bytes"]
    head_q8 = 49152 * 576 // 32 * 34
    for r in tp["ranks"]:
        assert abs(r["weight_bytes"] * 3 + head_q8 - full) <= 0.01 * full


def test_greedy_chat_matches_one_rank(server, shared_server):
    body = dict(CHAT, logprobs=True, top_logprobs=3)
    a = _post(server, "/v1/chat/completions", body)["choices"][0]
    b = _post(shared_server, "/v1/chat/completions", body)["choices"][0]
    assert a["message"]["content"] == b["message"]["content"]
    assert a["message"]["content"]
    la, lb = a["logprobs"]["content"], b["logprobs"]["content"]
    assert [t["token"] for t in la] == [t["token"] for t in lb]
    worst = max(abs(x["logprob"] - y["logprob"]) for x, y in zip(la, lb))
    assert worst < 1e-3


def test_stream_assembles_to_the_same_text(server):
    want = _post(server, "/v1/chat/completions", CHAT)["choices"][0]["message"]["content"]
    parts, finish = [], None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=dict(CHAT, stream=True),
                      timeout=server.http_timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"]
            if ch:
                parts.append(ch[0]["delta"].get("content") or "")
                finish = ch[0]["finish_reason"] or finish
    assert "".join(parts) == want and finish in ("stop", "length")


def test_seeded_samples_match_one_rank(server, shared_server):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 12, "n": 2, "seed": 7,
            "temperature": 0.9}
    a = [c["text"] for c in _post(server, "/v1/completions", body)["choices"]]
    b = [c["text"] for c in _post(shared_server, "/v1/completions", body)["choices"]]
    assert a == b and a[0] != a[1]


def test_json_schema_output_parses(server, shared_server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": "Invent a person."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": schema}}}
    choice = _post(server, "/v1/chat/completions", body)["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", text
    out = json.loads(text)
    assert set(out) == {"name", "age"} and isinstance(out["age"], int)
    ref = _post(shared_server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert text == ref


def test_cached_prefix_gives_the_uncached_answer(server, shared_server):
    system = "You are a careful assistant. " * 20
    first = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
             "messages": [{"role": "system", "content": system},
                          {"role": "user", "content": "Say hi."}]}
    second = dict(first, messages=[first["messages"][0],
                                   {"role": "user", "content": "Count to three."}])
    _post(server, "/v1/chat/completions", first)
    hit = _post(server, "/v1/chat/completions", second)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 100
    ref = _post(shared_server, "/v1/chat/completions", second)
    assert hit["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
