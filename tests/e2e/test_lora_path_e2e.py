"""SGLang's per-request ``lora_path`` over HTTP (issue 29): ``ferry serve --lora-paths`` on a
tiny seeded random Llama with two peft adapters made in the test
(``tests/engine/lora_helpers.py``).

Checked against transformers + peft (greedy token ids, log-probs within 1e-3): ``lora_path``
as a string on /v1/completions and /v1/chat/completions picks the adapter (whose tokens
differ from the base model's here); a list on a /v1/completions list of prompts runs each
prompt on its own adapter (``null``: the base) in one request; a ``model`` naming another
adapter is a 400 and an unknown name a 404, both naming ``lora_path``. The field's rules
over a fake engine: tests/unit/server/openai/test_lora_path.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from lora_helpers import check_choice  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 77, 120, 31], [200, 201, 7, 7, 40, 41], [12, 13, 99, 4]]
N = 5


@pytest.fixture(scope="module")
def setup(lora_checkpoints):
    """The session's tiny Llama and adapters (conftest.py) and their references here."""
    from lora_helpers import references

    root, models = lora_checkpoints
    refs = references(models, PROMPTS, N)
    for i in range(len(PROMPTS)):  # the adapters change the answer, so a wrong pick shows
        assert refs["a1"][i][0] != refs["base"][i][0] != refs["a2"][i][0]
    return root, refs


def test_lora_path(setup, make_server):
    root, refs = setup
    srv = make_server(["--model-path", str(root / "base"), "--device", "cpu", "--dtype",
                       "float32", "--served-model-name", "tiny", "--max-total-tokens", "2048",
                       "--lora-paths", f"a1={root / 'a1'}", f"a2={root / 'a2'}",
                       "--max-lora-rank", "16", "--max-loras-per-batch", "2"])
    srv.start()

    def complete(**body):
        return httpx.post(srv.url + "/v1/completions", timeout=srv.http_timeout, json={
            "max_tokens": N, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True, **body})

    # a string: the adapter, as model would pick it
    for name in ("a1", "a2"):
        r = complete(prompt=PROMPTS[0], lora_path=name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        check_choice(r.json()["choices"][0], refs[name][0], f"lora_path {name}")
    r = complete(prompt=PROMPTS[1], lora_path=None, model="tiny")
    check_choice(r.json()["choices"][0], refs["base"][1], "lora_path null")

    # a list: one adapter per prompt of one request (null: the base model)
    r = complete(prompt=PROMPTS, lora_path=["a2", None, "a1"])
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for i, (choice, name) in enumerate(zip(choices, ("a2", "base", "a1"))):
        check_choice(choice, refs[name][i], f"prompt {i} on {name}")

    # chat: the same adapter whichever field names it
    def chat(**body):
        return httpx.post(srv.url + "/v1/chat/completions", timeout=srv.http_timeout, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": N,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **body})

    by_path, by_model, base = chat(lora_path="a1"), chat(model="a1"), chat()
    assert by_path.status_code == 200, by_path.text
    assert by_path.json()["model"] == "a1"
    assert by_path.json()["choices"][0]["token_ids"] == by_model.json()["choices"][0][
        "token_ids"] != base.json()["choices"][0]["token_ids"]

    # refusals
    r = complete(prompt=PROMPTS[0], model="a1", lora_path="a2")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    r = complete(prompt=PROMPTS[0], lora_path="nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path", r.text
    r = complete(prompt=PROMPTS[:2], lora_path=["a1"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    srv.stop()
