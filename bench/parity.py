"""``ferry parity``: the same prompts, greedy, on two devices, same seeded weights.

Reports, per prompt, how many greedy steps the two devices agree for, and the largest
relative logit error ``||a - b|| / ||b||`` over the steps where their inputs were still equal.
Run it as ``ferry parity --model-path engine/configs/llama-tiny --load-format dummy
--devices cpu,cuda`` (or ``cpu,xpu`` to check an Intel card). fp32 by default.
``--devices cuda,cuda --kv-cache-dtypes auto,fp8_e4m3`` compares two KV cache dtypes on one
device instead (the FP8 cache's greedy agreement with the model-dtype cache).
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.bench_latency import _alloc
from engine.args import ServerArgs
from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import ForwardMode
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req
from server.cli import add_engine_args


@torch.inference_mode()
def greedy_trace(runner, prompts: list[list[int]], steps: int):
    """Greedy-decode ``steps`` tokens for each prompt as one batch.

    Returns (tokens: list[list[int]], logits: list of float32 CPU tensors [B, vocab]), one
    logits tensor per step (step 0 is the prefill's last position).
    """
    reqs = []
    for i, ids in enumerate(prompts):
        r = Req(f"parity-{i}", list(ids), SamplingParams(max_tokens=steps, temperature=0))
        r.req_pool_idx = runner.req_to_token_pool.alloc()
        reqs.append(r)
    logits_per_step = []
    try:
        locs = []
        for r in reqs:
            locs += _alloc(runner, r, len(r.origin_input_ids))
        batch = ScheduleBatch(ForwardMode.EXTEND, reqs, [0] * len(reqs),
                              [len(r.origin_input_ids) for r in reqs], [True] * len(reqs), locs)
        for step in range(steps):
            logits = runner.forward(batch).float()
            logits_per_step.append(logits.cpu())
            for r, t in zip(reqs, torch.argmax(logits, dim=-1).tolist()):
                r.output_ids.append(t)
            if step + 1 == steps:
                break
            prefix = [r.kv_len for r in reqs]
            locs = []
            for r in reqs:
                locs += _alloc(runner, r, 1)
            batch = ScheduleBatch(ForwardMode.DECODE, reqs, prefix, [1] * len(reqs),
                                  [True] * len(reqs), locs)
    finally:
        for r in reqs:
            runner.kv_pool.free_pages(r.pages)
            runner.req_to_token_pool.free(r.req_pool_idx)
    return [r.output_ids for r in reqs], logits_per_step


def compare(trace_a, trace_b) -> list[dict]:
    """Per prompt: steps agreed, and max relative logit error while inputs were equal."""
    toks_a, logits_a = trace_a
    toks_b, logits_b = trace_b
    out = []
    for i in range(len(toks_a)):
        agree = 0
        while agree < len(toks_a[i]) and toks_a[i][agree] == toks_b[i][agree]:
            agree += 1
        # logits of step s depend on tokens < s: comparable for s <= agree
        errs = []
        for s in range(min(agree + 1, len(logits_a))):
            a, b = logits_a[s][i].double(), logits_b[s][i].double()
            errs.append(float((a - b).norm() / b.norm()))
        out.append({"prompt": i, "steps": len(toks_a[i]), "steps_agreed": agree,
                    "max_rel_logit_err": max(errs) if errs else float("nan")})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ferry parity", description=__doc__)
    p.add_argument("--devices", default="cpu,cuda", help="two devices, comma-separated")
    p.add_argument("--tp-sizes", default="1,1",
                   help="tensor-parallel size on each device, comma-separated (e.g. 1,2: "
                        "one CPU rank against two GPUs)")
    p.add_argument("--kv-cache-dtypes", default=None,
                   help="KV cache dtype of each run, comma-separated (e.g. auto,fp8_e4m3); "
                        "default: --kv-cache-dtype for both")
    p.add_argument("--steps", type=int, default=32, help="greedy steps per prompt")
    p.add_argument("--num-prompts", type=int, default=4,
                   help="random prompts compared (default: 4)")
    p.add_argument("--prompt-len", type=int, default=48,
                   help="tokens per random prompt (default: 48)")
    add_engine_args(p)
    ns = p.parse_args(argv)
    devices = ns.devices.split(",")
    if len(devices) != 2:
        p.error("--devices takes exactly two devices, e.g. cpu,cuda")
    from engine.executor.model_runner import ModelRunner

    base = ServerArgs.from_cli_args(ns)
    if base.dtype == "auto":
        base = base.replace(dtype="float32")
    base = base.replace(max_total_tokens=base.max_total_tokens or
                        ns.num_prompts * (ns.prompt_len + ns.steps + 16),
                        disable_cuda_graph=True)
    traces = []
    vocab = None
    g = torch.Generator().manual_seed(base.seed)
    tps = [int(t) for t in ns.tp_sizes.split(",")]
    if len(tps) != 2:
        p.error("--tp-sizes takes two sizes, e.g. 1,2")
    kvs = (ns.kv_cache_dtypes or f"{base.kv_cache_dtype},{base.kv_cache_dtype}").split(",")
    if len(kvs) != 2:
        p.error("--kv-cache-dtypes takes two dtypes, e.g. auto,fp8_e4m3")
    for d, tp, kvd in zip(devices, tps, kvs):
        runner = ModelRunner(base.replace(device=d, tp_size=tp, kv_cache_dtype=kvd))
        vocab = runner.vocab_size
        if not traces:
            lens = [max(4, ns.prompt_len - 7 * i) for i in range(ns.num_prompts)]
            prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
        traces.append(greedy_trace(runner, prompts, ns.steps))
        runner.shutdown()
        del runner
    rows = compare(traces[0], traces[1])
    print(f"{devices[0]} (tp {tps[0]}, kv {kvs[0]}) vs {devices[1]} (tp {tps[1]}, kv {kvs[1]}), "
          f"dtype {base.dtype}, {ns.steps} greedy steps")
    for r in rows:
        print(f"  prompt {r['prompt']}: agreed {r['steps_agreed']}/{r['steps']} steps, "
              f"max rel logit err {r['max_rel_logit_err']:.2e}")
    summary = {"devices": devices, "tp_sizes": tps, "kv_cache_dtypes": kvs, "dtype": base.dtype,
               "min_steps_agreed": min(r["steps_agreed"] for r in rows),
               "max_rel_logit_err": max(r["max_rel_logit_err"] for r in rows)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
