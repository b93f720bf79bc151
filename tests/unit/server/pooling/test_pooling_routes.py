"""The pooling routes over the app and a fake engine (``app_helpers``): ``/v1/embeddings``
(string, list, token-id inputs; float and base64; ``dimensions`` with and without Matryoshka
support; ``user``'s bound), ``/v1/rerank``, ``/rerank`` and ``/v1/score`` (order, ``top_n``,
``return_documents``, one-to-many and pairwise), and each kind of server refusing the other
kind's routes with a 400 naming the route. The real engine's answers are checked against HF
transformers in tests/engine/test_pooling_models.py and tests/e2e/test_pooling_api.py."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import pytest
from app_helpers import make_app

from engine import io_struct as io

EMBED = {"task": "embed", "pooling": "last", "normalize": True, "matryoshka": False,
         "matryoshka_dims": [], "num_labels": 1, "hidden_size": 4}
SCORE = dict(EMBED, task="classify")


class CharTok:
    """A stand-in tokenizer: one id per character (a pair: both texts)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 200 + 1 for c in text]

    def __call__(self, text, pair=None, add_special_tokens=True):
        return {"input_ids": self.encode(text) + (self.encode(pair) if pair else [])}


def _client(pooling: dict | None):
    app, engine = make_app()
    if pooling is not None:
        engine.tm._dispatch(io.ReadyOut(rid="engine", max_total_tokens=4096,
                                        max_context_len=2048, max_running_requests=4,
                                        vocab_size=49152, pooling=pooling))
    engine.tm.chat.tokenizer = CharTok()
    # a vector from the prompt: [n, 1, 0, 0] normalised (n = its length)
    engine.pooled = lambda ids: [v / math.hypot(len(ids), 1) for v in (len(ids), 1, 0, 0)]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t"), \
        engine


async def test_embeddings_inputs_and_encodings():
    c, engine = _client(EMBED)
    r = await c.post("/v1/embeddings", json={"input": ["ab", "abcd"], "user": "u1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["usage"] == {"prompt_tokens": 6,
                                                           "total_tokens": 6}
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][0]["embedding"] == pytest.approx([2 / 5 ** 0.5, 1 / 5 ** 0.5, 0, 0])
    assert all(m.pooling for m in engine.sent)
    # token ids, one list or several, give what the text gives
    for inp in ([3, 4], [[3, 4], [5, 6, 7, 8]]):
        r = await c.post("/v1/embeddings", json={"input": inp})
        assert r.json()["data"][0]["embedding"] == body["data"][0]["embedding"]
    # base64: little-endian float32 of the same values
    r = await c.post("/v1/embeddings", json={"input": "ab", "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert list(struct.unpack("<4f", raw)) == pytest.approx(body["data"][0]["embedding"],
                                                            abs=1e-7)


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "user": "u" * 65}, "user"),
    ({"input": "x", "dimensions": 2}, "dimensions"),  # no Matryoshka support
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": [-1]}, "input"),
])
async def test_embeddings_errors(body, param):
    c, _ = _client(EMBED)
    r = await c.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_matryoshka_dimensions_truncate_and_renormalise():
    c, _ = _client(dict(EMBED, matryoshka=True))
    r = await c.post("/v1/embeddings", json={"input": "abc", "dimensions": 1})
    assert r.json()["data"][0]["embedding"] == pytest.approx([1.0])
    r = await c.post("/v1/embeddings", json={"input": "abc", "dimensions": 5})
    assert r.status_code == 400 and "above" in r.json()["error"]["message"]
    c, _ = _client(dict(EMBED, matryoshka=True, matryoshka_dims=[2, 4]))
    r = await c.post("/v1/embeddings", json={"input": "abc", "dimensions": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


async def test_rerank_and_score():
    c, engine = _client(SCORE)
    engine.pooled = lambda ids: [len(ids) / 100]  # longer pairs score higher
    docs = ["bb", {"text": "cccc"}, "a"]
    for path in ("/v1/rerank", "/rerank"):
        r = await c.post(path, json={"query": "q", "documents": docs})
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [x["index"] for x in res] == [1, 0, 2]
        assert res[0] == {"index": 1, "relevance_score": 0.05, "document": {"text": "cccc"}}
    r = await c.post("/v1/rerank", json={"query": "q", "documents": docs, "top_n": 1,
                                         "return_documents": False})
    assert r.json()["results"] == [{"index": 1, "relevance_score": 0.05}]
    assert r.json()["usage"]["total_tokens"] == 3 + 7
    r = await c.post("/v1/score", json={"text_1": "q", "text_2": ["bb", "a"]})
    body = r.json()
    assert body["object"] == "list" and body["data"] == [
        {"index": 0, "object": "score", "score": 0.03},
        {"index": 1, "object": "score", "score": 0.02}]
    r = await c.post("/v1/score", json={"text_1": ["q", "qq"], "text_2": ["bb", "a"]})
    assert [d["score"] for d in r.json()["data"]] == [0.03, 0.03]
    r = await c.post("/v1/score", json={"text_1": ["q", "qq"], "text_2": ["bb"] * 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"
    r = await c.post("/v1/rerank", json={"query": "q", "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


@pytest.mark.parametrize("pooling,path,body", [
    (None, "/v1/embeddings", {"input": "x"}),
    (None, "/v1/rerank", {"query": "q", "documents": ["d"]}),
    (None, "/v1/score", {"text_1": "q", "text_2": "d"}),
    (EMBED, "/v1/rerank", {"query": "q", "documents": ["d"]}),
    (SCORE, "/v1/embeddings", {"input": "x"}),
    (EMBED, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    (EMBED, "/v1/completions", {"prompt": "hi"}),
    (SCORE, "/v1/responses", {"input": "hi"}),
])
async def test_each_server_refuses_the_other_kind_naming_the_route(pooling, path, body):
    c, engine = _client(pooling)
    r = await c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert path in err["message"] and err["code"] == "route_not_supported"
    assert not engine.sent


async def test_health_generate_runs_a_pooling_request_on_a_pooling_server():
    c, engine = _client(EMBED)
    r = await c.get("/health_generate")
    assert r.status_code == 200, r.text
    assert engine.sent[-1].pooling


async def test_model_names_the_base_model():
    c, engine = _client(EMBED)
    r = await c.post("/v1/embeddings", json={"input": "x", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    engine.tm.lora_adapters = {"sql": "/adapters/sql"}
    r = await c.post("/v1/embeddings", json={"input": "x", "model": "sql"})
    assert r.status_code == 400 and "LoRA" in r.json()["error"]["message"]
