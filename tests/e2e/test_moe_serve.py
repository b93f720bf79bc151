"""``ferry serve`` on a tiny MoE checkpoint: start a server on a free port against a random
Qwen2-MoE (shared expert, a dense layer between MoE layers) saved in the Hub's per-expert
safetensors layout, answer one chat completion with the checkpoint's chat template, stop.

The checkpoint and its character-level tokenizer come from ``tests/engine/moe_helpers.py``;
its greedy tokens are compared with the offline engine's in ``tests/engine/test_moe_models``.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_chat_completion_on_a_tiny_moe_checkpoint(tiny_moe_checkpoint, make_server):
    ckpt, _ = tiny_moe_checkpoint("qwen2_moe_step2")  # the session's (tests/conftest.py)
    srv = make_server(["--model-path", str(ckpt), "--device", "cpu", "--dtype", "float32",
                       "--served-model-name", "tiny-moe", "--max-total-tokens", "2048"])
    srv.start()
    assert "Qwen2MoeForCausalLM" in srv.log()
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=srv.http_timeout, json={
        "model": "tiny-moe", "messages": [{"role": "user", "content": "Hello, experts!"}],
        "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny-moe"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == len("user: Hello, experts!\nassistant: ")
    assert isinstance(body["choices"][0]["message"]["content"], str)
    srv.stop()
    assert srv.proc.returncode is not None
