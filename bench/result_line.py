"""The result line of the engine benchmarks (``ferry bench-latency``, ``ferry bench-offline``):
one printed summary line per result and, with ``--result-jsonl``, the result dict appended to
that file as one JSON line. ``bench/hf_baseline.py --ferry-jsonl`` and the tests read those
lines, so their format (``json.dumps`` defaults, NaN written as ``NaN``) stays fixed."""

from __future__ import annotations

import json


def emit_result(res: dict, summary: str, jsonl_path: str | None) -> None:
    """Print ``summary``, then append ``res`` as one JSON line to ``jsonl_path`` (if given)."""
    print(summary)
    if jsonl_path:
        with open(jsonl_path, "a") as f:
            f.write(json.dumps(res) + "\n")
