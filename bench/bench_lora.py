"""What LoRA adapters cost a decode step (issue 29).

``python -m bench.bench_lora --model-path engine/configs/llama-3-8b.json --load-format dummy
--num-adapters 4 --lora-rank 16 --batch-size 1 64 --input-len 512`` builds two model runners
in one process over the same dummy weights (``--seed``): one without LoRA, one with
``--num-adapters`` random rank-``--lora-rank`` adapters on all seven projections
(q/k/v/o/gate/up/down, in host memory: no files) and ``--max-loras-per-batch`` equal to
that count. For each batch size it prefills ``bs`` random prompts in each runner, then
times decode steps round-robin (the growing context touches every kind alike):

- ``base``: the runner without LoRA (what the base model costs);
- ``base rows``: the LoRA runner, every request on the base model (the kernels run and skip
  every row: decode graphs hold them);
- ``adapters``: the LoRA runner, request i on adapter ``i % num_adapters`` (bs 1: adapter 0).

``--save-adapters DIR`` instead writes ``--num-adapters`` random adapters in peft's format
(``DIR/lora0`` ...; bf16, all seven projections) for the model's config, for a serving run:
``ferry serve ... --lora-paths DIR/lora0 ... --max-loras-per-batch 4`` and
``python -m bench.serving.bench_serving --model lora0,lora1,...`` (requests spread over the
adapters in turn).

Each figure is the median over ``--reps`` rounds of one step (device events after a
warm-up on accelerators, synchronised host clocks on the CPU), from before the batch is
built to after the argmax, as ``bench.bench_spec_steps`` times its steps; the ratio to
``base`` is the overhead the issue bounds (bs1 <= 1.10, bs64 mixed <= 1.20 on the H200; CPU
bs8 <= 1.3).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.bench_latency import _alloc, _Timer, prefill_random
from bench.result_line import emit_result
from engine import device as dev
from engine.args import ServerArgs
from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import ForwardMode
from engine.lora.adapter import LoRAAdapter
from engine.scheduler.request import Req
from server.cli import add_engine_args

KINDS = ("base", "base rows", "adapters")


def random_adapters(manager, n: int, rank: int, seed: int = 0) -> list[int]:
    """Register ``n`` random rank-``rank`` adapters on every target projection of
    ``manager``'s model; returns their ids."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for i in range(n):
        weights = {}
        for module, (_, _, k, out) in manager.targets.items():
            a = torch.randn(rank, k, generator=g) / k ** 0.5
            b = torch.randn(out, rank, generator=g) * (0.01 / rank ** 0.5)
            weights[module] = (a, b)
        ids.append(manager.register(LoRAAdapter(f"bench-{i}", "(random)", rank, weights)))
    return ids


def save_adapters(model_path: str, out_dir: str, n: int, rank: int, seed: int = 0) -> list[str]:
    """Write ``n`` random rank-``rank`` peft adapters (all seven projections, bf16) for the
    HF config at ``model_path`` (a config.json or a directory holding one) into
    ``out_dir/lora{i}``; returns their directories."""
    import json
    import os

    from safetensors.torch import save_file

    cfg_file = model_path if model_path.endswith(".json") else os.path.join(model_path,
                                                                          "config.json")
    with open(cfg_file) as f:
        c = json.load(f)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    d = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads) * d
    inter = c["intermediate_size"]
    shapes = {"self_attn.q_proj": (h, heads * d), "self_attn.k_proj": (h, kv),
              "self_attn.v_proj": (h, kv), "self_attn.o_proj": (heads * d, h),
              "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter), "mlp.down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    dirs = []
    for i in range(n):
        path = os.path.join(out_dir, f"lora{i}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(c["num_hidden_layers"]):
            for mod, (k, o) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{mod}"
                tensors[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, k, generator=g) / k ** 0.5).to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = (
                    torch.randn(o, rank, generator=g) * 0.01).to(torch.bfloat16)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": [m.split(".")[1] for m in shapes],
                       "bias": "none", "base_model_name_or_path": model_path}, f)
        dirs.append(path)
    return dirs


def _decode(runner, reqs: list[Req]) -> float:
    bs = len(reqs)
    with _Timer(runner.device_type) as t:
        prefix = [r.kv_len for r in reqs]
        locs = []
        for r in reqs:
            locs += _alloc(runner, r, 1)
        batch = ScheduleBatch(ForwardMode.DECODE, reqs, prefix, [1] * bs, [True] * bs, locs)
        nxt = torch.argmax(runner.forward(batch), dim=-1).tolist()
    for r, tok in zip(reqs, nxt):
        r.output_ids.append(tok)
    return t.elapsed


def _release(runner, reqs: list[Req]) -> None:
    for r in reqs:
        runner.kv_pool.free_pages(r.pages)
        runner.req_to_token_pool.free(r.req_pool_idx)


def measure(base_runner, lora_runner, adapter_ids: list[int], bs: int, input_len: int,
            reps: int, seed: int = 0) -> dict[str, list[float]]:
    """Per kind (``KINDS``), the decode step times in seconds of ``reps`` rounds."""
    g = torch.Generator().manual_seed(seed)
    base_reqs = prefill_random(base_runner, bs, input_len, g, "lora-bench-base")
    lora_reqs = prefill_random(lora_runner, bs, input_len, g, "lora-bench-lora")
    mixed = [adapter_ids[i % len(adapter_ids)] for i in range(bs)]
    times: dict[str, list[float]] = {k: [] for k in KINDS}

    def one(kind: str) -> float:
        if kind == "base":
            return _decode(base_runner, base_reqs)
        for r, aid in zip(lora_reqs, mixed):
            r.lora_id = aid if kind == "adapters" else None
        return _decode(lora_runner, lora_reqs)

    try:
        for kind in KINDS:  # warm-up
            one(kind)
        for _ in range(reps):
            for kind in KINDS:
                times[kind].append(one(kind))
    finally:
        _release(base_runner, base_reqs)
        _release(lora_runner, lora_reqs)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench_lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=20, help="timed rounds (each: every kind once)")
    p.add_argument("--result-jsonl", default=None)
    p.add_argument("--save-adapters", default=None, metavar="DIR",
                   help="only write --num-adapters random peft adapters for --model-path's "
                        "config into DIR/lora0 ... (for a serving run) and exit")
    add_engine_args(p)
    ns = p.parse_args(argv)
    if ns.save_adapters:
        for path in save_adapters(ns.model_path, ns.save_adapters, ns.num_adapters,
                                  ns.lora_rank, ns.seed):
            print(path)
        return
    per_req = ns.input_len + 3 * (ns.reps + 1) + 16
    args = ServerArgs.from_cli_args(ns)
    args = args.replace(max_total_tokens=args.max_total_tokens or max(ns.batch_size) * per_req,
                        max_running_requests=max(ns.batch_size), lora_paths=None,
                        enable_lora=False, max_lora_rank=None)
    from engine.executor.model_runner import ModelRunner

    base_runner = ModelRunner(args)
    lora_runner = ModelRunner(args.replace(enable_lora=True, max_lora_rank=ns.lora_rank,
                                           max_loras_per_batch=ns.num_adapters))
    ids = random_adapters(lora_runner.lora, ns.num_adapters, ns.lora_rank, args.seed)
    print(f"model={args.model_path or 'SmolLM2-135M-Instruct (embedded)'} "
          f"device={base_runner.device_type} ({dev.device_name(base_runner.device_type)}) "
          f"dtype={str(base_runner.dtype).replace('torch.', '')} adapters={ns.num_adapters} "
          f"rank={ns.lora_rank} slots={lora_runner.lora.slot_bytes() / 2**20:.1f} MiB")
    for bs in ns.batch_size:
        times = measure(base_runner, lora_runner, ids, bs, ns.input_len, ns.reps)
        base = statistics.median(times["base"])
        for kind, ts in times.items():
            med = statistics.median(ts)
            res = {"batch_size": bs, "input_len": ns.input_len, "kind": kind,
                   "num_adapters": ns.num_adapters, "lora_rank": ns.lora_rank,
                   "device": base_runner.device_type, "median_step_s": med,
                   "ratio_to_base": med / base}
            emit_result(res, f"bs={bs:<3} {kind:<10} median {med * 1e3:8.3f} ms  "
                        f"x{med / base:5.3f} of base", ns.result_jsonl)


if __name__ == "__main__":
    main()
