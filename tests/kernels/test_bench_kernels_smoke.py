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
