"""What a speculative verify step costs against a plain decode step (issue 26).

``python -m bench.bench_spec_steps --model-path engine/configs/llama-3-8b.json --load-format
dummy --batch-size 1 16 --input-len 512 --drafts 1 2 3 4 5 6 7 8`` prefills ``bs`` random
prompts, then times, round-robin so the growing context touches every kind alike:

- ``decode``: the engine's 1-token decode step (``ForwardMode.DECODE``: decode graphs where
  the device has them);
- ``verify k``: the forward a verify step runs (``engine/speculative/worker.py``
  ``verify_batch``) over ``1 + k`` tokens per request, logits for every row, and the greedy
  accept that follows it on the device (argmax of every row), in both of its forms:
  ``decode`` (k + 1 decode rows per request: decode graphs, the decode kernel) and
  ``extend`` (an EXTEND over the cached prefix). The engine picks ``decode`` while the KV
  the extra rows read stays small against the weights.

Each figure is the median over ``--reps`` rounds of one step's elapsed time (device events
after a warm-up round on accelerators, synchronised host clocks on the CPU), from before
the batch is built to after the argmax: host preparation is counted, as it is in a serving
step. The ratio ``verify k / decode`` is what a verify step costs in decode steps; with a
mean accept length ``a`` (tokens emitted per verify step), speculation speeds decoding up
by ``a / ratio`` (proposer time not counted: NGRAM's is host-side and ~10 us; a draft
model's is measured separately).
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
from engine.scheduler.request import Req
from engine.speculative.worker import verify_batch
from server.cli import add_engine_args


def _step(runner, reqs: list[Req], drafts: int, as_decode: bool, gen: torch.Generator) -> float:
    """One decode (``drafts == 0``) or verify step of ``drafts`` random drafts per request,
    as decode rows or as an EXTEND (``as_decode``); the requests keep the tokens (the next
    round's context is longer)."""
    bs = len(reqs)
    with _Timer(runner.device_type) as t:
        prefix = [r.kv_len for r in reqs]
        locs = []
        if drafts:
            for r in reqs:
                r.output_ids += torch.randint(0, runner.vocab_size, (drafts,),
                                              generator=gen).tolist()
        for r in reqs:
            locs += _alloc(runner, r, 1 + drafts)
        if drafts:
            batch = verify_batch(reqs, prefix, [1 + drafts] * bs, locs, as_decode)
        else:
            batch = ScheduleBatch(ForwardMode.DECODE, reqs, prefix, [1] * bs, [True] * bs, locs)
        logits = runner.forward(batch)
        nxt = torch.argmax(logits, dim=-1).tolist()
    rows = 1 + drafts
    for i, r in enumerate(reqs):
        r.output_ids.append(nxt[i * rows + rows - 1])
    return t.elapsed


def measure(runner, bs: int, input_len: int, drafts: list[int], reps: int,
            seed: int = 0) -> dict[tuple[int, str], list[float]]:
    """Per ``(draft count, form)`` (``(0, "decode")``: the plain decode step; forms
    ``"decode"`` and ``"extend"`` of each verify step), the step times in seconds of
    ``reps`` rounds."""
    g = torch.Generator().manual_seed(seed)
    times: dict[tuple[int, str], list[float]] = {(0, "decode"): []}
    times.update({(k, f): [] for k in drafts for f in ("decode", "extend")})
    reqs = prefill_random(runner, bs, input_len, g, "spec-bench")
    try:
        for k, form in times:  # warm-up: compiles each extend length's kernels
            _step(runner, reqs, k, form == "decode", g)
        for _ in range(reps):
            for (k, form), ts in times.items():
                ts.append(_step(runner, reqs, k, form == "decode", g))
    finally:
        for r in reqs:
            runner.kv_pool.free_pages(r.pages)
            runner.req_to_token_pool.free(r.req_pool_idx)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench_spec_steps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8],
                   help="draft tokens per request of the verify steps timed")
    p.add_argument("--reps", type=int, default=20, help="timed rounds (each: every kind once)")
    p.add_argument("--result-jsonl", default=None)
    add_engine_args(p)
    ns = p.parse_args(argv)
    rounds = ns.reps + 1
    per_req = ns.input_len + rounds * (1 + sum(2 * (1 + k) for k in ns.drafts)) + 16
    args = ServerArgs.from_cli_args(ns)
    # decode graphs up to the verify rows of the largest batch (as the engine sizes them for
    # speculation: engine/executor/graph_runner.py)
    args = args.replace(max_total_tokens=args.max_total_tokens or max(ns.batch_size) * per_req,
                        max_running_requests=max(ns.batch_size),
                        speculative_algorithm=args.speculative_algorithm or "NGRAM",
                        speculative_max_batch_size=max(ns.batch_size),
                        speculative_num_draft_tokens=max(ns.drafts))
    from engine.executor.model_runner import ModelRunner

    runner = ModelRunner(args)
    print(f"model={args.model_path or 'SmolLM2-135M-Instruct (embedded)'} "
          f"device={runner.device_type} ({dev.device_name(runner.device_type)}) "
          f"dtype={str(runner.dtype).replace('torch.', '')}")
    for bs in ns.batch_size:
        times = measure(runner, bs, ns.input_len, ns.drafts, ns.reps)
        base = statistics.median(times[0, "decode"])
        for (k, form), ts in times.items():
            med = statistics.median(ts)
            res = {"batch_size": bs, "input_len": ns.input_len, "drafts": k, "form": form,
                   "device": runner.device_type, "median_step_s": med,
                   "ratio_to_decode": med / base}
            what = "decode" if k == 0 else f"verify k={k} {form}"
            emit_result(res, f"bs={bs} {what:<19} median {med * 1e3:8.3f} ms  "
                        f"x{med / base:5.2f} of decode (speedup = accept length / "
                        f"{med / base:.2f})", ns.result_jsonl)


if __name__ == "__main__":
    main()
