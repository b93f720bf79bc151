"""docs/architecture.md stays true: every path it names exists, and the size rule of the
layout (no module over 600 lines in engine/, server/, kernels/ or bench/; 450 is only the
before-stop hook's warning) holds. tests/unit/test_code_rules.py checks the function and mixin
rules."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def test_every_path_in_the_architecture_doc_exists():
    text = DOC.read_text()
    paths = set(re.findall(r"`((?:engine|server|kernels|bench|tests|docs)/[\w./]*)`", text))
    assert len(paths) > 25, "the doc should name the files of the request path"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"


def test_no_module_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for d in ("engine", "server", "kernels", "bench")
            for p in (ROOT / d).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}, long
