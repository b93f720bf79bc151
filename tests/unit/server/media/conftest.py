"""Shared by the image tests over the HTTP app: the tiny Qwen2.5-VL tokenizer of
``tests/engine/vl_helpers.py``, saved and loaded once a module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "engine"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    from vl_helpers import save_tokenizer

    path = tmp_path_factory.mktemp("vl_tok")
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)
