"""``bench/kernels/bench_kernels.py --smoke`` runs end to end in the interpreter and agrees with torch."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kernel_test_utils import ON_GPU


@pytest.mark.skipif(ON_GPU, reason="--smoke is the CPU interpreter mode")
def test_bench_smoke_runs_and_checks_errors(capsys):
    from bench.kernels import bench_kernels

    # main() exits 1 if any Triton output disagrees with the torch reference/SDPA.
    bench_kernels.main(["--smoke", "--batch-sizes", "2", "--contexts", "70",
                        "--extend", "2:30:17"])
    out = capsys.readouterr().out
    assert "## decode attention" in out and "## extend attention" in out
    assert "MISMATCH" not in out


@pytest.mark.skipif(ON_GPU, reason="--smoke is the CPU interpreter mode")
def test_bench_mla_smoke_runs_and_agrees(capsys):
    from bench.kernels import bench_mla

    assert bench_mla.main(["--smoke"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 2 and all(float(r[-1]) < 1e-4 for r in rows)


@pytest.mark.skipif(ON_GPU, reason="--smoke is the CPU interpreter mode")
def test_bench_mla_smoke_over_an_fp8_latent(capsys):
    """The e4m3 pools through the kernel's FP8 path: the fp16 dots' error, no more."""
    from bench.kernels import bench_mla

    assert bench_mla.main(["--smoke", "--kv-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[2:]]
    assert "latent fp8_e4m3" in out
    assert len(rows) == 2 and all(float(r[-1]) < 2e-3 for r in rows)


@pytest.mark.skipif(ON_GPU, reason="--smoke is the CPU interpreter mode")
def test_bench_mla_configs_and_sweep_smoke(capsys, monkeypatch):
    """``--configs`` gives a row per configuration; ``--sweep`` (its candidates cut to one
    each) prints the best per shape and the line of picks for the table."""
    from bench.kernels import bench_mla

    assert bench_mla.main(["--smoke", "--configs", "default,legacy,64x32x8x2v2",
                           "--batch-sizes", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[2] for r in rows] == ["16x16x8x2*", "16x32x4x2", "64x32x8x2v2"]
    assert all(float(r[-1]) < 1e-4 for r in rows)
    monkeypatch.setattr(bench_mla, "SWEEP_CANDIDATES", {(16, "auto"): ["legacy"],
                                                        (16, "fp8_e4m3"): ["legacy"]})
    assert bench_mla.main(["--smoke", "--sweep", "--batch-sizes", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("best bs1 ctx70:") == 2
    line = next(x for x in out.splitlines() if x.startswith("MLA_DECODE_TAGS = {"))
    assert "(16, '16bit'): " in line and "(None, 'fp8'): " in line


@pytest.mark.skipif(ON_GPU, reason="--dry-run on the CPU is the interpreter mode")
def test_moe_mxfp4_bench_dry_run(tmp_path, capsys):
    import json

    from bench.kernels import bench_moe_mxfp4

    out = tmp_path / "moe.json"
    bench_moe_mxfp4.main(["--dry-run", "--result-json", str(out)])
    records = json.loads(out.read_text())
    assert [r["m"] for r in records] == [1, 3]
    assert all(r["mxfp4"]["weight_bytes"] * 3.7 < r["bf16"]["weight_bytes"] for r in records)
    # the GEMV path (M = 1 in the dry run): default tiles, self-routed, one tile variant
    assert {"gemv", "routed", "topk+gemv", "topk+grouped"} <= set(records[0]) and "gemv" not in records[1]
    assert len(records[0]["tiles"]) == 1
    assert "mxfp4" in capsys.readouterr().out


@pytest.mark.skipif(ON_GPU, reason="--dry-run on the CPU is the interpreter mode")
def test_moe_decode_bench_dry_run(tmp_path, capsys):
    """Two tile choices of a few dozen programs a launch (``--tiles``): the default ones aim
    at 1024 and 512 programs, a GPU's figures, and took 13 s in the interpreter (48 s under
    load; 3.5 s now)."""
    import json

    from bench.kernels import bench_moe_decode

    out = tmp_path / "moe-decode.json"
    bench_moe_decode.main(["--dry-run", "--tiles", "8,4096", "--tiles", "16,2048",
                           "--result-json", str(out)])
    text = capsys.readouterr().out
    assert "MISMATCH" not in text and "grouped" in text
    assert "decode[8,4096]" in text and "decode[16,2048]" in text
    rows = json.loads(out.read_text())
    assert [r["M"] for r in rows] == [1, 3]
    for r in rows:
        assert r["grouped_us"] > 0 and r["decode_8_4096"] > 0 and r["decode_16_2048"] > 0
        assert r["decode_8_4096_tiles"] != r["decode_16_2048_tiles"]
