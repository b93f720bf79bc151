"""Speculative decoding against plain decoding, in one process on one model (issue 26).

``python -m bench.bench_speculative`` builds one engine with ``--speculative-algorithm``
(NGRAM by default; EAGLE, EAGLE3 and STANDALONE with ``--draft-model-path``; MTP from the
target checkpoint's own MTP layer, or a dummy one with ``--load-format dummy``) and runs each
workload twice on it: with the verify steps switched off (the scheduler's ``spec`` set
aside: plain decode steps) and on, greedy. With EAGLE the target's piecewise graphs are
off in both modes (prefill runs eagerly: they do not keep the head's hidden states).
Workloads, as
chat requests through the model's chat template:

- ``copy``: copy-heavy requests (repeat a paragraph, rename a variable in a function, echo
  a list), where the answer quotes the prompt;
- ``other``: open requests (a story, an explanation), where it mostly does not.

Greedy: in float32 the outputs must be identical with speculation (checked: the run stops
otherwise); in 16-bit they are compared and the differing requests reported.

Batch N sends N requests at once, batch after batch (the workload's requests cycled until
each ran at least once and the last batch is full; batch 1 runs them one after another).
Output tok/s = generated tokens / wall time of the whole generate call (prefill included,
the same for both modes). The mean accept length is tokens emitted per request and verify
step (accepted drafts + 1).
"""

from __future__ import annotations

import argparse
import itertools
import time

from bench.result_line import emit_result

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He "
             "trimmed the wick, polished the great lens, and wrote the weather in his log: "
             "wind from the west, seas moderate, two ships passing north before midnight.")
FUNCTION = ("def summarize(records):\n    total = 0\n    count = 0\n    for rec in records:\n"
            "        if rec.valid:\n            total += rec.amount\n            count += 1\n"
            "    average = total / count if count else 0.0\n"
            "    return {'total': total, 'count': count, 'average': average}\n")
ITEMS = ("apples, bread, butter, carrots, cheddar cheese, eggs, flour, honey, lemons, milk, "
         "oats, olive oil, onions, pasta, rice, salt, spinach, sugar, tomatoes, yoghurt")

WORKLOADS = {
    "copy": [
        f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
        f"Rename the variable `total` to `amount_sum` in this function and show the whole "
        f"function:\n\n```python\n{FUNCTION}```",
        f"Echo this shopping list back to me, one item per line:\n\n{ITEMS}",
    ],
    "other": [
        "Write a short story about a fox who learns to swim.",
        "Explain how a refrigerator keeps food cold.",
        "Give me three tips for learning a new language.",
    ],
}


def _chat(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def _run(llm, prompts: list[list[int]], bs: int, sp) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), bs):  # batches of bs at once, one after another
        outs += llm.generate(prompts[i:i + bs], sp)
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    from engine import LLM, SamplingParams
    from engine.speculative.worker import mean_accept_length

    p = argparse.ArgumentParser(prog="bench_speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto",
                   help="dummy: random weights (a GPU run of a config's shape; their greedy "
                        "outputs did not repeat within 256 tokens on the H200, so NGRAM's "
                        "drafts land on real weights only)")
    p.add_argument("--disable-cuda-graph", action="store_true", help="every step eager")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="the largest decode graph's rows (default: the server's)")
    p.add_argument("--gguf-dequantize", action="store_true",
                   help="a GGUF model's weights dequantized to --dtype (not kept in blocks)")
    p.add_argument("--tokenizer-path", default=None,
                   help="the chat template's tokenizer (needed for a config without one)")
    p.add_argument("--algorithm", default="NGRAM")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--draft-model-path", default=None,
                   help="EAGLE/EAGLE3/STANDALONE: the draft head or model (with --load-format "
                        "dummy, an EAGLE head directory may hold only its config.json)")
    p.add_argument("--num-steps", type=int, default=None,
                   help="EAGLE/EAGLE3/STANDALONE/MTP: the draft chain's length")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="runs per mode; the fastest counts")
    p.add_argument("--result-jsonl", default=None)
    ns = p.parse_args(argv)

    llm = LLM(ns.model_path, device=ns.device, dtype=ns.dtype, load_format=ns.load_format,
              tokenizer_path=ns.tokenizer_path, gguf_dequantize=ns.gguf_dequantize,
              disable_cuda_graph=ns.disable_cuda_graph,
              speculative_algorithm=ns.algorithm,
              speculative_num_draft_tokens=ns.num_draft_tokens,
              speculative_draft_model_path=ns.draft_model_path,
              speculative_num_steps=ns.num_steps,
              speculative_max_batch_size=max(ns.batch_sizes),
              **({} if ns.cuda_graph_max_bs is None
                 else {"cuda_graph_max_bs": ns.cuda_graph_max_bs}))
    sched, worker = llm.scheduler, llm.scheduler.spec
    runner_dtype = str(llm.runner.dtype).replace("torch.", "")
    exact = runner_dtype == "float32"  # outputs must then be identical with speculation
    sp = SamplingParams(max_tokens=ns.max_tokens, temperature=0)
    # host clocks around the worker's two phases: build (propose: a draft model's forwards;
    # allocate) and run (step: the verify forward and acceptance); both end in a host sync
    # (drafts and accepted tokens come back as lists), so wall time is device time included
    phase = {"build": 0.0, "run": 0.0}

    def timed(name, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if out is not None:  # a build without drafts (backing off) is no round
                phase[name] += time.perf_counter() - t0
            return out
        return call

    worker.build, worker.step = timed("build", worker.build), timed("run", worker.step)
    # warm-up: both modes, a batch of each size (first calls pay allocator and kernel setup)
    warm = [_chat(llm.tokenizer, t) for t in WORKLOADS["copy"]]
    for spec, bs in itertools.product((None, worker), ns.batch_sizes):
        sched.spec = spec
        _run(llm, (warm * bs)[:max(bs, 2)], bs, SamplingParams(max_tokens=16, temperature=0))
    for wl, bs in itertools.product(ns.workloads, ns.batch_sizes):
        texts = WORKLOADS[wl]
        n = -(-max(bs, len(texts)) // bs) * bs  # every text at least once, whole batches
        prompts = [_chat(llm.tokenizer, t) for t in itertools.islice(itertools.cycle(texts), n)]
        res: dict = {}
        for mode in ("off", ns.algorithm):
            sched.spec = None if mode == "off" else worker
            best, ids = float("inf"), None
            for _ in range(ns.repeats):
                worker.reset_stats()
                phase.update(build=0.0, run=0.0)
                dt, got = _run(llm, prompts, bs, sp)
                best = min(best, dt)
                ids = ids or got
                if got != ids and exact:
                    raise SystemExit(f"{wl} bs{bs} {mode}: outputs differ between repeats")
            res[mode] = (best, ids, mean_accept_length(sched.stats))
        (t_off, ids_off, _), (t_on, ids_on, acc_len) = res["off"], res[ns.algorithm]
        rounds = sched.stats["spec_verify_steps"]  # of the last repeat, as `phase`
        same = sum(a == b for a, b in zip(ids_on, ids_off))
        if same < len(ids_off):
            if exact:
                raise SystemExit(f"{wl} bs{bs}: greedy outputs differ with {ns.algorithm}")
            # 16-bit: a verify forward's batch shape differs from a decode step's, so its
            # reductions round differently and near-tied greedy choices can flip
            firsts = [_first_diff(a, b) for a, b in zip(ids_on, ids_off) if a != b]
            print(f"{wl} bs{bs}: {len(firsts)} of {len(ids_off)} greedy outputs differ "
                  f"({runner_dtype}), first at output tokens {firsts}")
        n_out = sum(len(x) for x in ids_off)
        row = {"bench": "speculative", "algorithm": ns.algorithm, "workload": wl,
               "batch_size": bs, "requests": len(prompts), "identical_outputs": same,
               "output_tokens": n_out,
               "off_output_tok_s": n_out / t_off, "spec_output_tok_s": n_out / t_on,
               "speedup": t_off / t_on, "mean_accept_length": acc_len,
               "num_draft_tokens": worker.k, "verify_steps": rounds}
        # per speculative round (propose + verify) against a plain step of the off run (its
        # wall time over its steps: prefill included, a percent or two at these lengths)
        if rounds:
            plain = t_off * bs / n_out
            row.update(draft_ms=phase["build"] / rounds * 1e3,
                       verify_ms=phase["run"] / rounds * 1e3, plain_step_ms=plain * 1e3,
                       round_cost_in_plain_steps=(phase["build"] + phase["run"]) / rounds / plain)
        emit_result(row, f"{wl:5s} bs{bs}: {n_out} output tokens; off {n_out / t_off:6.1f} "
                         f"tok/s, {ns.algorithm} {n_out / t_on:6.1f} tok/s: {t_off / t_on:.2f}x "
                         f"(mean accept length {acc_len or 0:.2f})"
                         + (f"; a round: draft {row['draft_ms']:.2f} ms + verify "
                            f"{row['verify_ms']:.2f} ms = {row['round_cost_in_plain_steps']:.2f} "
                            f"plain steps of {row['plain_step_ms']:.2f} ms" if rounds else ""),
                   ns.result_jsonl)
    sched.spec = worker


if __name__ == "__main__":
    main()
