"""``ferry serve`` on a tiny Gemma 2 checkpoint: sliding-window layers (a window of 8 tokens,
shorter than the prompt) with attention and final logit soft-capping, through the whole
server. The greedy chat completion must be HF ``generate``'s tokens on the same prompt (the
checkpoint's chat template applied by its tokenizer). One server for the module.

The checkpoint and its character-level tokenizer come from ``tests/engine/gemma_helpers.py``;
the offline engine's parity (batch, prefix cache, chunked prefill, TP) is
``tests/engine/test_gemma_models.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import FerryServer

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

MESSAGES = [{"role": "user", "content": "Hello, windows and soft caps!"}]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(server, HF model, checkpoint dir) of a tiny random Gemma 2."""
    from gemma_helpers import save_tiny

    ckpt = tmp_path_factory.mktemp("gemma2")
    hf = save_tiny("gemma2", ckpt)
    srv = FerryServer(tmp_path_factory.mktemp("ferry-gemma"), [
        "--model-path", str(ckpt), "--device", "cpu", "--dtype", "float32",
        "--served-model-name", "tiny-gemma", "--max-total-tokens", "2048"])
    srv.start()
    try:
        yield srv, hf, ckpt
    finally:
        srv.stop()


def test_greedy_chat_completion_equals_hf(gemma):
    from transformers import AutoTokenizer

    srv, hf, ckpt = gemma
    assert "Gemma2ForCausalLM" in srv.log()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert len(ids) > 8                                    # longer than the window
    x = torch.tensor([ids])
    with torch.no_grad():
        seq = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    want = tok.decode(seq[0, len(ids):].tolist(), skip_special_tokens=True)
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=srv.http_timeout, json={
        "model": "tiny-gemma", "messages": MESSAGES, "max_tokens": NEW_TOKENS,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == NEW_TOKENS
    assert body["choices"][0]["message"]["content"] == want
