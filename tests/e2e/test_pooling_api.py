"""``ferry serve`` on tiny random pooling checkpoints (``tests/engine/pooling_helpers.py``):
an embedder (a ``Qwen3Model`` with a sentence-transformers last-token pooling config) and a
``Qwen3ForSequenceClassification`` cross-encoder, each against HF transformers on the same
weights. Two start-ups in all; the other checks run in-process
(``tests/engine/test_pooling_models.py``, ``tests/unit/server/pooling/test_pooling_routes.py``)."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

ARGS = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048"]
TEXTS = ["Hello, embeddings!", "ferry serves vectors too", "a"]


def test_embeddings_server(tmp_path, make_server):
    import openai
    from pooling_helpers import save_embedder
    from transformers import AutoTokenizer

    hf = save_embedder(tmp_path / "emb")
    tok = AutoTokenizer.from_pretrained(tmp_path / "emb")
    srv = make_server(["--model-path", str(tmp_path / "emb"), "--served-model-name", "emb",
                       *ARGS])
    srv.start()
    url = srv.url
    r = httpx.post(url + "/v1/embeddings", timeout=srv.http_timeout,
                   json={"model": "emb", "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [tok.encode(t) for t in TEXTS]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)),
                             "total_tokens": sum(map(len, ids))}
    for i, d in enumerate(body["data"]):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids[i]])).last_hidden_state[0, -1]
        ref = torch.nn.functional.normalize(ref, dim=-1)
        cos = torch.nn.functional.cosine_similarity(torch.tensor(d["embedding"]), ref, dim=0)
        assert d["index"] == i and cos.item() >= 0.9999
    # the official client (it asks for base64 and decodes it), and token-id input
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model="emb", input=TEXTS[0])
    assert got.data[0].embedding == pytest.approx(body["data"][0]["embedding"], abs=1e-6)
    r = httpx.post(url + "/v1/embeddings", timeout=srv.http_timeout,
                   json={"input": ids[0], "encoding_format": "base64"})
    floats = torch.frombuffer(bytearray(base64.b64decode(r.json()["data"][0]["embedding"])),
                              dtype=torch.float32)
    assert floats.tolist() == pytest.approx(body["data"][0]["embedding"], abs=1e-6)
    # a generation route, and dimensions without Matryoshka support: 400s naming them
    r = httpx.post(url + "/v1/chat/completions", timeout=srv.http_timeout,
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/embeddings", timeout=srv.http_timeout,
                   json={"input": "x", "dimensions": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    assert httpx.get(url + "/model_info").json()["is_generation"] is False
    srv.stop()


def test_rerank_and_score_server(tmp_path, make_server):
    from pooling_helpers import save_cross_encoder
    from transformers import AutoTokenizer

    hf = save_cross_encoder(tmp_path / "ce")
    tok = AutoTokenizer.from_pretrained(tmp_path / "ce")
    srv = make_server(["--model-path", str(tmp_path / "ce"), *ARGS])
    srv.start()
    query, docs = "what is ferry?", ["an inference server", "a boat", "a river crossing"]

    def ref(q, d) -> float:
        with torch.no_grad():
            logit = hf(input_ids=torch.tensor([tok(q, d)["input_ids"]])).logits[0, 0]
        return torch.sigmoid(logit).item()

    want = [ref(query, d) for d in docs]
    r = httpx.post(srv.url + "/v1/rerank", timeout=srv.http_timeout,
                   json={"query": query, "documents": [docs[0], {"text": docs[1]}, docs[2]]})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [x["index"] for x in res] == sorted(range(3), key=lambda i: -want[i])
    for x in res:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        assert x["document"]["text"] == docs[x["index"]]
    r = httpx.post(srv.url + "/v1/score", timeout=srv.http_timeout,
                   json={"text_1": query, "text_2": docs})
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)
    r = httpx.post(srv.url + "/v1/embeddings", timeout=srv.http_timeout, json={"input": "x"})
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    srv.stop()
