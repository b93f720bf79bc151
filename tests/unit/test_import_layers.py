"""The import contracts of ``.importlinter`` hold: engine/'s layer order (no import runs back
up), no import cycles between sibling modules, engine and kernels below server and bench.

Runs import-linter's ``lint-imports`` (a dev dependency) from the repository root, as a
developer would; its report names each broken contract and the import chain that breaks it.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    assert lint.exists(), f"{lint} is missing: install the dev extras (pip install -e '.[dev]')"
    # --no-cache: always the imports of the files as they are, and nothing written to the tree
    proc = subprocess.run([str(lint), "--no-cache", "--no-logo", ".importlinter"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"lint-imports exited {proc.returncode}:\n" \
                                 f"{proc.stdout}\n{proc.stderr}"
