"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedded_llm():
    """One offline ``LLM`` on the embedded SmolLM2 (CPU, fp32, 8192 KV tokens, 512-token
    prefill chunks) for the modules that only run requests through it
    (tests/engine/test_generate.py, tests/engine/test_grammar.py): a test that changes a
    scheduler knob puts it back before it returns."""
    from engine import LLM

    llm = LLM(model_path=None, device="cpu", max_total_tokens=8192, chunked_prefill_size=512)
    yield llm
    llm.shutdown()
