"""CPU smoke run of ``bench.bench_lora`` on the tiny dummy config: every kind is timed for
every batch size, the adapters really change the LoRA runner's logits, and both runners'
KV pools and request rows are whole afterwards."""

from __future__ import annotations

import json

import torch

from engine.loader.loader import config_dir


def test_bench_lora_rows_and_pools(tmp_path):
    from bench.bench_lora import KINDS, main, measure, random_adapters
    from engine.args import ServerArgs
    from engine.executor.model_runner import ModelRunner

    out = tmp_path / "lora.jsonl"
    args = ["--model-path", config_dir("llama-tiny"), "--load-format", "dummy", "--device",
            "cpu", "--batch-size", "1", "3", "--input-len", "8", "--reps", "2",
            "--num-adapters", "2", "--lora-rank", "8", "--result-jsonl", str(out)]
    main(args)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch_size"], r["kind"]) for r in rows] == [(b, k) for b in (1, 3)
                                                            for k in KINDS]
    assert all(r["median_step_s"] > 0 for r in rows)
    assert [r["ratio_to_base"] for r in rows if r["kind"] == "base"] == [1.0, 1.0]

    a = ServerArgs(model_path=config_dir("llama-tiny"), load_format="dummy", device="cpu",
                   max_total_tokens=256, max_running_requests=4, enable_lora=True,
                   max_lora_rank=8, max_loras_per_batch=2)
    base, lora = ModelRunner(a.replace(enable_lora=False, max_lora_rank=None)), ModelRunner(a)
    ids = random_adapters(lora.lora, 2, 8)
    free = (base.kv_pool.num_free_pages, lora.kv_pool.num_free_pages,
            base.req_to_token_pool.available(), lora.req_to_token_pool.available())
    times = measure(base, lora, ids, 3, 8, reps=1)
    assert {k: len(v) for k, v in times.items()} == {k: 1 for k in KINDS}
    assert free == (base.kv_pool.num_free_pages, lora.kv_pool.num_free_pages,
                    base.req_to_token_pool.available(), lora.req_to_token_pool.available())
    # the random adapters change the output (else the figures time nothing)
    x = torch.randn(3, lora.model_config.hidden_size)
    layer = lora.model.model.layers[0].mlp.gate_up_proj
    slots, _ = lora.lora.slots_for(ids[:1] * 3)
    lora.lora.set_batch([0, 1, 2], [1, 1, 1], slots)
    with torch.inference_mode():
        y = layer(x)
        lora.lora.set_batch([0, 1, 2], [1, 1, 1], [-1] * 3)
        assert not torch.allclose(y, layer(x))


def test_saved_adapters_load_and_change_the_output(tmp_path):
    """``--save-adapters`` writes peft directories that ferry loads (every projection of
    every layer) and that change the greedy answer."""
    from bench.bench_lora import main
    from engine import LLM
    from engine.sampling.params import SamplingParams

    cfg = config_dir("llama-tiny")
    main(["--save-adapters", str(tmp_path), "--model-path", cfg, "--num-adapters", "2",
          "--lora-rank", "8"])
    llm = LLM(cfg, load_format="dummy", device="cpu", max_total_tokens=512,
              lora_paths=[str(tmp_path / "lora0"), str(tmp_path / "lora1")])
    assert sorted(a["name"] for a in llm.runner.lora.list()) == ["lora0", "lora1"]
    assert all(len(a.weights) == 14 for a in llm.runner.lora.adapters.values())
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    base, ad = llm.generate([[5, 6, 7], [5, 6, 7]], sp, lora=[None, "lora0"])
    assert [lp[0] for lp in base.logprobs] != [lp[0] for lp in ad.logprobs]


def test_bench_serving_spreads_requests_over_models():
    """``bench_serving --model a,b,c``: request i goes to name i % 3 (a stub server answers
    each stream with one token)."""
    import asyncio

    import httpx

    from bench.serving.serving_client import run_benchmark
    from bench.serving.workloads import RequestInput

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return httpx.Response(404)
        seen.append(json.loads(request.content)["model"])
        body = ('data: {"choices":[{"index":0,"text":"x"}]}\n\n'
                'data: {"choices":[],"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    reqs = [RequestInput([1, 2], 2, 1) for _ in range(7)]
    out = asyncio.run(run_benchmark("http://t", reqs, model="a,b,c", max_concurrency=1,
                                    transport=httpx.MockTransport(handler)))
    assert seen == ["a", "b", "c", "a", "b", "c", "a"]
    assert out["model"] == "a,b,c"
