"""CPU smoke runs of the benchmark commands on a tiny dummy model (seconds each). The GPU
figures in docs/benchmarks.md come from the same commands on an H200."""

import json

import pytest

from engine.loader.loader import config_dir

TINY = ["--model-path", None, "--load-format", "dummy", "--device", "cpu"]


@pytest.fixture(scope="module")
def tiny_args():
    return [a if a is not None else config_dir("llama-tiny") for a in TINY]


def test_bench_latency_jsonl(tiny_args, tmp_path, capsys):
    from bench.bench_latency import main

    out = tmp_path / "lat.jsonl"
    main(tiny_args + ["--batch-size", "1", "3", "--input-len", "16", "--output-len", "5",
                      "--result-jsonl", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in rows] == [(1, 16, 5),
                                                                                (3, 16, 5)]
    for r in rows:
        bs, il = r["batch_size"], r["input_len"]
        assert r["prefill_throughput_tok_s"] == pytest.approx(bs * il / r["prefill_latency_s"])
        assert r["median_decode_throughput_tok_s"] == pytest.approx(
            bs / r["median_decode_latency_s"])
        assert r["total_latency_s"] > r["prefill_latency_s"] > 0
    assert "decode median" in capsys.readouterr().out


def test_bench_offline_counts_every_token(tiny_args, tmp_path):
    from bench.bench_offline import main

    out = tmp_path / "off.jsonl"
    main(tiny_args + ["--num-prompts", "6", "--min-input-len", "4", "--max-input-len", "20",
                      "--min-output-len", "2", "--max-output-len", "7",
                      "--result-jsonl", str(out)])
    r = json.loads(out.read_text())
    assert r["num_prompts"] == 6
    assert 6 * 2 <= r["output_tokens"] <= 6 * 7  # ignore_eos: each gets its drawn length
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["duration_s"])


def test_parity_cpu_against_itself(tiny_args, capsys):
    from bench.parity import main

    main(tiny_args[:-2] + ["--devices", "cpu,cpu", "--steps", "4", "--num-prompts", "2",
                           "--prompt-len", "10"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["min_steps_agreed"] == 4 and summary["max_rel_logit_err"] == 0.0


def test_bench_spec_steps_rows_and_pool(tiny_args, tmp_path):
    """Every kind (decode, verify k) is timed ``reps`` times per batch size, and the KV pool
    and request slots are all back afterwards (a leak would shrink later runs)."""
    from bench.bench_spec_steps import main, measure
    from engine.args import ServerArgs
    from engine.executor.model_runner import ModelRunner

    out = tmp_path / "spec.jsonl"
    main(tiny_args + ["--batch-size", "1", "2", "--input-len", "12", "--drafts", "1", "3",
                      "--reps", "2", "--result-jsonl", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [(0, "decode")] + [(k, f) for k in (1, 3) for f in ("decode", "extend")]
    assert [(r["batch_size"], r["drafts"], r["form"]) for r in rows] == \
        [(b, k, f) for b in (1, 2) for k, f in kinds]
    for r in rows:
        assert r["median_step_s"] > 0
        assert r["ratio_to_decode"] == pytest.approx(
            r["median_step_s"] / next(b["median_step_s"] for b in rows
                                      if b["batch_size"] == r["batch_size"] and not b["drafts"]))
    runner = ModelRunner(ServerArgs(model_path=tiny_args[1], load_format="dummy", device="cpu",
                                    max_total_tokens=512, max_running_requests=2))
    free_pages = runner.kv_pool.num_free_pages
    times = measure(runner, 2, 10, [2], reps=3)
    assert {k: len(v) for k, v in times.items()} == {(0, "decode"): 3, (2, "decode"): 3,
                                                     (2, "extend"): 3}
    assert runner.kv_pool.num_free_pages == free_pages


def _saved(cfg, architecture: str, tmp_path) -> str:
    """Save the tiny config ``cfg`` as ``architecture`` (dummy weights read only it)."""
    cfg.architectures = [architecture]
    cfg.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_bench_vision_jsonl(tmp_path):
    """ferry bench-vision on the tiny Qwen2.5-VL config (dummy weights): one 112-pixel image
    (16 tokens) with 20 text tokens."""
    from vl_helpers import config

    from bench.bench_vision import main

    out = tmp_path / "vision.jsonl"
    main(["--model-path", _saved(config(), "Qwen2_5_VLForConditionalGeneration", tmp_path), "--load-format", "dummy", "--device", "cpu",
          "--dtype", "float32", "--image-size", "112", "--text-len", "20", "--repeats", "1",
          "--result-jsonl", str(out)])
    row = json.loads(out.read_text())
    assert (row["image_tokens"], row["text_tokens"]) == (16, 20)
    assert row["ttft_s"] > 0 and row["encoder_s"] > 0 and row["ttft_text_s"] > 0


def test_bench_vision_gemma3_jsonl(tmp_path):
    """ferry bench-vision on the tiny Gemma 3 config (dummy weights): its fixed 56-pixel
    image (16 tokens, whatever --image-size) with 20 text tokens."""
    from vl_helpers import gemma3_config

    from bench.bench_vision import main

    out = tmp_path / "vision.jsonl"
    main(["--model-path", _saved(gemma3_config(), "Gemma3ForConditionalGeneration", tmp_path), "--load-format", "dummy", "--device", "cpu",
          "--dtype", "float32", "--image-size", "112", "--text-len", "20", "--repeats", "1",
          "--result-jsonl", str(out)])
    row = json.loads(out.read_text())
    assert (row["image_tokens"], row["text_tokens"]) == (16, 20)
    assert row["ttft_s"] > 0 and row["encoder_s"] > 0


def test_bench_vision_serving_jsonl(tmp_path):
    """ferry bench-vision-serving on the tiny Qwen2.5-VL config (dummy weights): 3 requests
    at 50/s, each one 112-pixel image (16 tokens) and 20 text tokens, then the text load."""
    from vl_helpers import config

    from bench.bench_vision_serving import main

    out = tmp_path / "vision-serving.jsonl"
    main(["--model-path", _saved(config(), "Qwen2_5_VLForConditionalGeneration", tmp_path), "--load-format", "dummy", "--device", "cpu",
          "--dtype", "float32", "--image-size", "112", "--text-len", "20", "--output-len", "4",
          "--num-requests", "3", "--request-rate", "50", "--result-jsonl", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["load"], r["prompt_tokens"], r["requests"]) for r in rows] == \
        [("image", 36, 3), ("text", 36, 3)]
    for r in rows:
        assert 0 < r["ttft_median_s"] <= r["ttft_p99_s"] and r["itl_median_s"] > 0
        assert r["output_tok_s"] > 0 and r["req_s"] > 0
