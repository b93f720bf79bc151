"""``ferry bench-latency``: one static batch, prefill then decode, timed (like SGLang's
``bench_one_batch``).

Prints prefill latency (s) and throughput (input tok/s), median decode step latency (s) and
throughput (output tok/s), and total latency/throughput. ``--result-jsonl`` appends one JSON
line per (batch size, input len, output len). Times come from device events after a warm-up
run where the device has them, else from synchronised host clocks.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from bench.result_line import emit_result
from engine import device as dev
from engine.args import ServerArgs
from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import ForwardMode
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req
from server.cli import add_engine_args


class _Timer:
    """Elapsed seconds of a region: device events on accelerators, host clock on the CPU."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.ev = dev.event_class(device_type)

    def __enter__(self):
        if self.ev is not None:
            self.a, self.b = self.ev(enable_timing=True), self.ev(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.ev is not None:
            self.b.record()
            self.b.synchronize()
            self.elapsed = self.a.elapsed_time(self.b) / 1e3
        else:
            self.elapsed = time.perf_counter() - self.t0


def _alloc(runner, req: Req, n: int) -> list[int]:
    slots = runner.kv_pool.grow(req.pages, req.kv_len, n)
    if slots is None:
        raise RuntimeError("KV pool too small for this batch; lower --batch-size or lengths")
    req.kv_len += n
    return slots


def _rows(runner, r: Req) -> Req:
    """Give ``r`` a ``req_to_token`` row and, for a model with linear-attention layers, a
    zeroed recurrent-state slot (``runner.state_pool``)."""
    r.req_pool_idx = runner.req_to_token_pool.alloc()
    pool = getattr(runner, "state_pool", None)
    if pool is not None:
        r.state_slot = pool.alloc()
    return r


def release_rows(runner, r: Req) -> None:
    """Free what :func:`_rows` and the KV allocations gave ``r``."""
    runner.kv_pool.free_pages(r.pages)
    runner.req_to_token_pool.free(r.req_pool_idx)
    if r.state_slot is not None:
        runner.state_pool.free(r.state_slot)


def prefill_random(runner, bs: int, input_len: int, g: torch.Generator, tag: str) -> list[Req]:
    """``bs`` requests of ``input_len`` random prompt tokens (from ``g``), given request rows
    (and state slots) and KV slots and prefilled in one EXTEND, each with its greedy first
    token appended: the starting point of the decode-step benchmarks (``bench_spec_steps``,
    ``bench_lora``). The caller frees each with :func:`release_rows`."""
    reqs = []
    for i in range(bs):
        ids = torch.randint(0, runner.vocab_size, (input_len,), generator=g).tolist()
        reqs.append(_rows(runner, Req(f"{tag}-{i}", ids,
                                      SamplingParams(max_tokens=1 << 20, temperature=0))))
    locs = []
    for r in reqs:
        locs += _alloc(runner, r, input_len)
    logits = runner.forward(ScheduleBatch(ForwardMode.EXTEND, reqs, [0] * bs, [input_len] * bs,
                                          [True] * bs, locs))
    for r, tok in zip(reqs, torch.argmax(logits, dim=-1).tolist()):
        r.output_ids.append(tok)
    return reqs


def run_once(runner, bs: int, input_len: int, output_len: int, seed: int = 0,
             decode_context=None) -> dict:
    """Prefill ``bs`` random prompts of ``input_len`` tokens, then ``output_len - 1`` greedy
    decode steps. Returns the timings (seconds). ``decode_context`` (e.g. a profiler) is
    entered around the decode steps only."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    reqs = []
    for i in range(bs):
        ids = torch.randint(0, vocab, (input_len,), generator=g).tolist()
        reqs.append(_rows(runner, Req(f"bench-{i}", ids,
                                      SamplingParams(max_tokens=output_len, temperature=0))))
    try:
        locs = []
        for r in reqs:
            locs += _alloc(runner, r, input_len)
        batch = ScheduleBatch(ForwardMode.EXTEND, reqs, [0] * bs, [input_len] * bs,
                              [True] * bs, locs)
        with _Timer(runner.device_type) as t:
            logits = runner.forward(batch)
            nxt = torch.argmax(logits, dim=-1)
        prefill = t.elapsed
        for r, tok in zip(reqs, nxt.tolist()):
            r.output_ids.append(tok)
        steps = []
        ctx = decode_context if decode_context is not None else contextlib.nullcontext()
        with ctx:
            _decode_steps(runner, reqs, output_len - 1, steps)
    finally:
        for r in reqs:
            release_rows(runner, r)
    return {"prefill_s": prefill, "decode_steps_s": steps}


def _decode_steps(runner, reqs: list[Req], n: int, steps: list[float]) -> None:
    bs = len(reqs)
    for _ in range(n):
        prefix = [r.kv_len for r in reqs]
        locs = []
        for r in reqs:
            locs += _alloc(runner, r, 1)
        batch = ScheduleBatch(ForwardMode.DECODE, reqs, prefix, [1] * bs, [True] * bs, locs)
        with _Timer(runner.device_type) as t:
            logits = runner.forward(batch)
            nxt = torch.argmax(logits, dim=-1)
        steps.append(t.elapsed)
        for r, tok in zip(reqs, nxt.tolist()):
            r.output_ids.append(tok)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ferry bench-latency", description=__doc__)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1],
                   help="requests in the static batch; several values: one run each "
                        "(default: 1)")
    p.add_argument("--input-len", type=int, nargs="+", default=[256],
                   help="prompt tokens per request; several values: one run each (default: 256)")
    p.add_argument("--output-len", type=int, nargs="+", default=[16],
                   help="decode steps per request; several values: one run each (default: 16)")
    p.add_argument("--result-jsonl", default=None, help="append one JSON line per configuration")
    p.add_argument("--no-warmup", action="store_true",
                   help="time the first run too (graphs, Triton compilation included)")
    add_engine_args(p)
    ns = p.parse_args(argv)
    need = max(ns.batch_size) * (max(ns.input_len) + max(ns.output_len) + 8)
    args = ServerArgs.from_cli_args(ns)
    if args.max_total_tokens is None:
        args = args.replace(max_total_tokens=need)
    args = args.replace(max_running_requests=max(max(ns.batch_size), 1),
                        context_length=args.context_length or None)
    from engine.executor.model_runner import ModelRunner

    runner = ModelRunner(args)
    print(f"model={args.model_path or 'SmolLM2-135M-Instruct (embedded)'} "
          f"device={runner.device_type} ({dev.device_name(runner.device_type)}) "
          f"dtype={str(runner.dtype).replace('torch.', '')} kv_tokens={runner.max_total_tokens}")
    for bs in ns.batch_size:
        for il in ns.input_len:
            for ol in ns.output_len:
                if not ns.no_warmup:
                    run_once(runner, bs, il, min(ol, 4))
                r = run_once(runner, bs, il, ol)
                steps = r["decode_steps_s"]
                med = statistics.median(steps) if steps else float("nan")
                total = r["prefill_s"] + sum(steps)
                res = {
                    "batch_size": bs, "input_len": il, "output_len": ol,
                    "device": runner.device_type, "dtype": str(runner.dtype).replace("torch.", ""),
                    "prefill_latency_s": r["prefill_s"],
                    "prefill_throughput_tok_s": bs * il / r["prefill_s"],
                    "median_decode_latency_s": med,
                    "median_decode_throughput_tok_s": bs / med if steps else float("nan"),
                    "total_latency_s": total,
                    "total_throughput_tok_s": bs * (il + ol) / total,
                }
                emit_result(res, f"bs={bs} in={il} out={ol} | prefill "
                            f"{res['prefill_latency_s']:.4f} s "
                            f"({res['prefill_throughput_tok_s']:.0f} tok/s) | decode median "
                            f"{med:.5f} s ({res['median_decode_throughput_tok_s']:.1f} tok/s) "
                            f"| total {total:.3f} s ({res['total_throughput_tok_s']:.0f} tok/s)",
                            ns.result_jsonl)


if __name__ == "__main__":
    main()
