"""LoRA adapters over HTTP (issue 29): ``ferry serve --lora-paths`` on a tiny seeded random
Llama with peft adapters made in the test (``tests/engine/lora_helpers.py``).

Checked against transformers + peft: greedy completions (token ids and log-probs within
1e-3) for the base, an adapter of --lora-paths picked by ``model: "name"`` and one loaded at
run time picked by ``model: "base:name"``, the three concurrently; ``/v1/models`` lists the
adapters with ``parent``; load/unload at SGLang's and vLLM's paths; the errors (unknown
adapter 404 naming ``model``, bad path 400 naming ``lora_path``, unknown body field 400).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

PROMPTS = [[5, 9, 14, 3, 77, 120, 31], [200, 201, 7, 7, 40, 41]]
N = 5


@pytest.fixture(scope="module")
def setup(lora_checkpoints):
    """The session's tiny Llama and adapters (conftest.py) and their references here."""
    from lora_helpers import references

    root, models = lora_checkpoints
    return root, references(models, PROMPTS, N)


def _complete(srv, model, prompt):
    r = httpx.post(srv.url + "/v1/completions", timeout=srv.http_timeout, json={
        "model": model, "prompt": prompt, "max_tokens": N, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_token_ids": True})
    return r


def _check(r, ref, what):
    from lora_helpers import check_choice

    assert r.status_code == 200, f"{what}: {r.text}"
    check_choice(r.json()["choices"][0], ref, what)


def test_lora_serving(setup, make_server):
    root, refs = setup
    srv = make_server(["--model-path", str(root / "base"), "--device", "cpu", "--dtype",
                       "float32", "--served-model-name", "tiny", "--max-total-tokens", "2048",
                       "--lora-paths", f"a1={root / 'a1'}", "--max-lora-rank", "16",
                       "--max-loras-per-batch", "2", "--max-loaded-loras", "3"])
    srv.start()
    models = httpx.get(srv.url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("a1", "tiny")]
    _check(_complete(srv, "a1", PROMPTS[0]), refs["a1"][0], "a1")
    _check(_complete(srv, "tiny", PROMPTS[0]), refs["base"][0], "base")

    # load at run time (vLLM's path), pick with SGLang's "base:name"
    r = httpx.post(srv.url + "/v1/load_lora_adapter", timeout=srv.http_timeout,
                   json={"lora_name": "a2", "lora_path": str(root / "a2")})
    assert r.status_code == 200, r.text
    assert set(r.json()["loaded_adapters"]) == {"a1", "a2"}
    _check(_complete(srv, "tiny:a2", PROMPTS[1]), refs["a2"][1], "tiny:a2")

    # base + two adapters at once, twice each
    jobs = [(m, i) for m in ("tiny", "a1", "a2") for i in range(2)]
    with ThreadPoolExecutor(len(jobs)) as ex:
        outs = list(ex.map(lambda j: _complete(srv, j[0], PROMPTS[j[1]]), jobs))
    for (m, i), r in zip(jobs, outs):
        _check(r, refs["base" if m == "tiny" else m][i], f"{m} concurrent")

    # the openai client, model "a1"
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    c = client.completions.create(model="a1", prompt=PROMPTS[1], max_tokens=N,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})
    assert c.model == "a1" and c.choices[0].token_ids == refs["a1"][1][0]
    # loading through the client's plain post (docs/usage.md shows it)
    client.post("/load_lora_adapter", cast_to=object,
                body={"lora_name": "again", "lora_path": str(root / "a1")})
    assert "again" in [m.id for m in client.models.list().data]
    c = client.completions.create(model="again", prompt=PROMPTS[0], max_tokens=N,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})
    assert c.choices[0].token_ids == refs["a1"][0][0]
    client.post("/unload_lora_adapter", cast_to=object, body={"lora_name": "again"})

    # streaming and n=2 on an adapter give its greedy tokens too
    r = httpx.post(srv.url + "/v1/completions", timeout=srv.http_timeout, json={
        "model": "a1", "prompt": PROMPTS[1], "max_tokens": N, "temperature": 0,
        "ignore_eos": True, "n": 2, "return_token_ids": True})
    assert [ch["token_ids"] for ch in r.json()["choices"]] == [refs["a1"][1][0]] * 2, r.text
    streamed = []
    for ev in client.completions.create(model="tiny:a2", prompt=PROMPTS[0], max_tokens=N,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True,
                                                    "return_token_ids": True}):
        if ev.choices:
            streamed += getattr(ev.choices[0], "token_ids", None) or []
    assert streamed == refs["a2"][0][0]

    # errors
    r = _complete(srv, "nope", PROMPTS[0])
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "'nope'" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/load_lora_adapter", json={"lora_name": "bad",
                                                         "lora_path": str(root / "missing")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    r = httpx.post(srv.url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": "y",
                                                         "pinned": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "pinned"
    r = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"

    # unload (SGLang's path): the name is gone for new requests
    r = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a1"}
    assert _complete(srv, "tiny:a2", PROMPTS[1]).status_code == 404
    assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["tiny", "a1"]
    _check_tokenize_names_and_the_loaded_limit(srv, root)
    srv.stop()


def _load(srv, name, path):
    return httpx.post(srv.url + "/load_lora_adapter", timeout=srv.http_timeout,
                      json={"lora_name": name, "lora_path": str(path)})


def _check_tokenize_names_and_the_loaded_limit(srv, root):
    """Issue 41 item 5: /v1/tokenize takes ``lora_path`` (and ``model``) as the generation
    routes do, tokens unchanged; adapter names are bounded (length, characters); an
    unloaded adapter that a running request still uses counts against --max-loaded-loras
    (3 here; a1 is the only adapter loaded when this starts)."""
    import threading

    def tok(**kw):
        return httpx.post(srv.url + "/v1/tokenize", json={"prompt": "hello", **kw})

    base = tok().json()["tokens"]
    for kw in ({"lora_path": "a1"}, {"lora_path": ["a1"]}, {"model": "tiny:a1"},
               {"model": "a1", "lora_path": "a1"}):
        r = tok(**kw)
        assert r.status_code == 200 and r.json()["tokens"] == base, (kw, r.text)
    r = tok(lora_path="nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path", r.text
    assert tok(model="a1", lora_path="a2").status_code == 404  # a2 is unloaded by now

    for bad in ("x" * 257, "has space", "a/b", "caf\u00e9", "x:y"):
        r = _load(srv, bad, root / "a2")
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", (bad, r.text)
    assert "257 characters" in _load(srv, "x" * 257, root / "a2").json()["error"]["message"]

    # a1 held by running requests, then unloaded: still in memory, so a1 + b1 + b2 = 3
    out = {}
    long = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        srv.url + "/v1/completions", timeout=srv.http_timeout, json={
            "model": "a1", "prompt": PROMPTS[0], "max_tokens": 300, "n": 16,
            "temperature": 1.0, "ignore_eos": True})))
    long.start()
    deadline = time.monotonic() + 60
    while httpx.get(srv.url + "/server_info").json()["num_running"] == 0:
        assert time.monotonic() < deadline and long.is_alive()
        time.sleep(0.02)
    assert httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
    assert _load(srv, "b1", root / "a1").status_code == 200
    assert _load(srv, "b2", root / "a2").status_code == 200
    r = _load(srv, "b3", root / "a2")
    running = httpx.get(srv.url + "/server_info").json()["num_running"]
    assert running > 0, "the requests on a1 ended too soon for this check"
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert "still used by running requests" in r.json()["error"]["message"]
    long.join()
    assert out["r"].status_code == 200  # finished on a1 after its unload
    assert _load(srv, "b3", root / "a2").status_code == 200  # a1 left with its requests


def test_lora_under_data_parallel(setup, make_server):
    """--dp-size 2: an adapter loaded over HTTP reaches both replicas (round robin sends the
    requests to each), and an unload leaves neither with it."""
    root, refs = setup
    srv = make_server(["--model-path", str(root / "base"), "--device", "cpu", "--dtype",
                       "float32", "--served-model-name", "tiny", "--max-total-tokens", "1024",
                       "--enable-lora", "--max-lora-rank", "16", "--dp-size", "2",
                       "--load-balance-method", "round_robin"])
    srv.start()
    r = httpx.post(srv.url + "/load_lora_adapter", timeout=srv.http_timeout,
                   json={"lora_name": "a2", "lora_path": str(root / "a2")})
    assert r.status_code == 200, r.text
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: _complete(srv, "a2", PROMPTS[i % 2]), range(4)))
    for i, r in enumerate(outs):
        _check(r, refs["a2"][i % 2], f"a2 at dp 2, request {i}")
    stats = httpx.get(srv.url + "/server_info").json()["replicas"]
    assert len(stats) == 2
    r = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}
    assert _complete(srv, "a2", PROMPTS[0]).status_code == 404
    srv.stop()
