"""docs/models.md is the registry's table (engine/models/docs.py regenerates it), and what it
says of each class holds for the models it builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_model_config import _tiny

from engine.models import MODEL_REGISTRY
from engine.models.docs import DOC_PATH, models_table

ROOT = Path(__file__).resolve().parents[4]


def test_models_doc_is_generated_from_the_registry():
    assert (ROOT / DOC_PATH).read_text() == models_table(), \
        "docs/models.md is stale: run `python -m engine.models.docs --write`"
    for arch in MODEL_REGISTRY:
        assert f"`{arch}`" in models_table()


def test_readme_and_architecture_doc_link_the_table():
    assert "docs/models.md" in (ROOT / "README.md").read_text()
    assert "docs/models.md" in (ROOT / "docs" / "architecture.md").read_text()


@pytest.mark.parametrize("arch", sorted(MODEL_REGISTRY))
def test_layer_specs_are_within_the_documented_kinds(arch):
    cls = MODEL_REGISTRY[arch]
    assert cls.family, f"{cls.__name__} has no family for docs/models.md"
    with torch.device("meta"):
        model = cls(_tiny(arch), torch.float32)
    specs = model.layer_specs()
    assert len(specs) == model.model_config.num_layers
    assert {s.attention for s in specs} <= set(cls.attention_kinds)
    assert {s.cache for s in specs} <= set(cls.cache_kinds)
    # each attention layer holds its layer's spec (whole-model and this rank's agree at tp 1)
    assert [a.spec for a in model.attention_layers()] == specs
