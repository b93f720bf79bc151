"""bench/moefuse_report.py: the fused/unfused ratios of stage ``moe-fuse`` from its jsonl
files, and a missing run reported as missing."""

from __future__ import annotations

import json

from bench import moefuse_report


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_ratios_and_missing_runs(tmp_path, capsys):
    lat = lambda bs, s: {"batch_size": bs, "median_decode_latency_s": s}  # noqa: E731
    _write(tmp_path / "moefuse-qwen3-30b-a3b-on.jsonl", [lat(1, 0.00294), lat(64, 0.018)])
    _write(tmp_path / "moefuse-qwen3-30b-a3b-off.jsonl", [lat(1, 0.0042), lat(64, 0.018)])
    lora = lambda bs, kind, s, r: {"batch_size": bs, "kind": kind,  # noqa: E731
                                   "median_step_s": s, "ratio_to_base": r}
    _write(tmp_path / "moefuse-lora-on.jsonl", [lora(1, "base", 0.005, 1.0),
                                                lora(1, "adapters", 0.0055, 1.1)])
    _write(tmp_path / "moefuse-lora-off.jsonl", [lora(1, "base", 0.005, 1.0),
                                                 lora(1, "adapters", 0.0064, 1.28)])
    moefuse_report.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b bs1: fused 2.940 ms, unfused 4.200 ms, fused/unfused 0.700" in out
    assert "roofline 1.47 ms: fused 0.50, unfused 0.35 (target 0.5)" in out
    assert "qwen3-30b-a3b bs64: fused 18.000 ms, unfused 18.000 ms, fused/unfused 1.000" in out
    assert "mixtral-8x7b: missing on run" in out
    assert "lora bs1: adapters 5.500 ms fused (1.100x base), 6.400 ms unfused (1.280x base)" \
        in out
