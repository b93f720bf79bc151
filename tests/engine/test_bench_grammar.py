"""CPU smoke run of ``ferry bench-grammar`` on the tiny dummy model (a few steps, seconds).
The figures in docs/benchmarks.md come from the same command on the embedded model (CPU)
and on an H200 (``bench/h200_run.sh grammar``)."""

import json

import pytest

from engine.loader.loader import config_dir


def test_bench_grammar_reports_every_field(tmp_path, capsys):
    pytest.importorskip("xgrammar")
    from bench.grammar.bench_grammar import main

    out = tmp_path / "grammar.json"
    assert main(["--model-path", config_dir("llama-tiny"), "--load-format", "dummy",
                 "--device", "cpu", "--batch-size", "4", "--input-len", "8", "--steps", "4",
                 "--block", "2", "--warmup-steps", "1", "--compile-repeats", "1",
                 "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["batch_size"] == 4 and r["device"] == "cpu"
    assert set(r["decode"]) == {"free", "constrained", "mixed"}  # no overlap on the CPU
    for kind in r["decode"].values():
        assert kind["steps"] == 4
        assert kind["median_step_s"] > 0 and kind["mean_step_s"] > 0 and kind["tok_s"] > 0
    assert r["ratio_constrained"] > 0 and r["ratio_mixed"] > 0 and r["rounds"] == 2
    assert r["paired_ratio_constrained"] > 0 and r["paired_ratio_mixed"] > 0
    # prefill, the warm-up block (1 step) and 2 timed blocks of 2 steps: none finished
    assert r["constrained_tokens_min"] >= 1 + 1 + 2 * 2
    assert r["sample_output"].startswith('{"records": [')
    assert r["grammar_host"]["fill_ms"] > 0 and r["grammar_host"]["apply_ms"] > 0
    comp = r["compile"]
    assert comp["backend_init_s"] > 0 and len(comp["rows"]) == 12
    for row in comp["rows"]:
        assert row["cold_ms"] > 0 and row["cached_ms"] > 0 and row["chars"] > 0
    text = capsys.readouterr().out
    assert "constrained/free" in text and "cold ms" in text


def test_bench_grammar_compiles_the_tests_constraints():
    """Every constraint the structured-output tests use (bench/grammar/grammar_cases.py, which those
    tests import) is among the ones the benchmark compiles."""
    from bench.grammar import bench_grammar as bg
    from bench.grammar import grammar_cases as gc

    texts = {text for _, _, text in bg.test_constraints()}
    for schema in (*gc.SCHEMAS.values(), gc.PERSON, gc.WEATHER):
        assert json.dumps(schema) in texts
    assert gc.REGEX in texts and gc.EBNF in texts


def test_bench_grammar_help_lists_only_its_flags(capsys):
    from bench.grammar.bench_grammar import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "--batch-size" in text and "--result-file" in text
    assert "--max-running-requests" not in text and "--port" not in text
