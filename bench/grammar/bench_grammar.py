"""``ferry bench-grammar``: what grammar-constrained decoding (xgrammar) costs.

(a) Decode steps at batch size B through the engine's scheduler (``LLM``, the same code as
the server's engine process): B free requests, B requests each constrained by ``LONG_SCHEMA``
(an array of at least 512 records: no request can complete it inside the run) and a mixed
batch (half of each). Greedy, ``ignore_eos``, random prompts of ``--input-len`` tokens. The
2B requests are prefilled once and stay alive; the scheduler's running list holds one group
at a time (the others keep their KV), and the kinds of step are timed in alternating blocks,
so load drift on a shared machine hits them alike. Every timed step is a decode step of
exactly B requests that adds one token to each (checked; a request that finishes early is
an error).

Times: host clock around each ``Scheduler.step()``, the device synchronised at block edges
(with overlap scheduling a block's first step, which fills the pipeline, is not timed);
medians over the timed steps, and a paired ratio (the median over the rounds of the ratio
of two kinds' medians in the same round), which load that drifts slower than a round does
not move. With overlap scheduling (accelerators) a free
step's time is then the device step, while a constrained step runs without overlap (its
mask needs the previous step's ids) and also holds the host's work; so the free batch is
also timed with overlap off ("free-sync"): constrained / free-sync is the grammar's own
cost, free-sync / free the overlap given up. The mask work of one step at the end state
(``fill_vocab_mask`` over the B matchers on the host, ``apply_vocab_mask`` on [B, V] logits
on the device, checked against xgrammar's CPU kernel) is timed alone as well.

(b) Compile time of every constraint of ``tests/engine/test_grammar.py`` and
``tests/e2e/test_structured_api.py`` (and of ``LONG_SCHEMA``) through ``GrammarBackend``:
cold (the backend's and xgrammar's caches cleared: the first request for that text) and
cached (the second request for the same text), medians over ``--compile-repeats``.

``--result-file`` writes everything as one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import random
import statistics
import time

from bench.bench_latency import _Timer
from bench.grammar.grammar_cases import EBNF, PERSON, REGEX, SCHEMAS, TIME_TZ, WEATHER
from engine import device as dev
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req

#: the constrained requests' schema: records of every JSON value kind (integer, string,
#: number, array of strings, boolean), at least 512 of them, so a request cannot finish
LONG_SCHEMA = {"type": "object", "properties": {"records": {
    "type": "array", "minItems": 512, "items": {
        "type": "object", "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                     "maxItems": 3},
            "active": {"type": "boolean"}},
        "required": ["id", "name", "score", "tags", "active"],
        "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}

# with bench/grammar/grammar_cases.py's, two short constraints that tests/e2e/test_structured_api.py
# writes inline
PHONE = r"\d{3}-\d{4}"
RED_GREEN = 'root ::= "red" | "green"'


def test_constraints() -> list[tuple[str, str, str]]:
    """``(name, kind, text)`` of every constraint the tests send, as the server passes them
    to the engine (schemas as ``json.dumps`` text; ``guided_choice`` as its EBNF;
    ``tool_choice: "required"`` as its calls schema), then ``LONG_SCHEMA``."""
    from server.tools.plan import calls_schema

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "get_time", "parameters": TIME_TZ}}]
    out = [(f"schema:{k}", "json_schema", json.dumps(v)) for k, v in SCHEMAS.items()]
    out += [("regex:phone-10", "regex", REGEX), ("ebnf:yes-no", "ebnf", EBNF),
            ("schema:person", "json_schema", json.dumps(PERSON)),
            ("schema:weather (named tool)", "json_schema", json.dumps(WEATHER)),
            ("schema:tools required", "json_schema", json.dumps(calls_schema(tools, True))),
            ("schema:json_object", "json_schema", '{"type": "object"}'),
            ("regex:phone-7", "regex", PHONE), ("ebnf:red|green (choice)", "ebnf", RED_GREEN),
            ("schema:long (decode bench)", "json_schema", json.dumps(LONG_SCHEMA))]
    return out


def compile_times(tokenizer, vocab_size: int, eos_ids: list[int], repeats: int) -> dict:
    """(b): backend construction time, then cold and cached compile medians per constraint."""
    from engine.sampling.grammar import GrammarBackend

    t0 = time.perf_counter()
    backend = GrammarBackend(tokenizer, vocab_size, eos_ids)
    init_s = time.perf_counter() - t0
    rows = []
    for name, kind, text in test_constraints():
        cold, cached = [], []
        for _ in range(repeats):
            backend.compiler.clear_cache()
            backend.cache.clear()
            t0 = time.perf_counter()
            backend.submit(kind, text).result()
            t1 = time.perf_counter()
            backend.submit(kind, text).result()
            t2 = time.perf_counter()
            cold.append(t1 - t0)
            cached.append(t2 - t1)
        rows.append({"name": name, "kind": kind, "chars": len(text),
                     "cold_ms": statistics.median(cold) * 1e3,
                     "cached_ms": statistics.median(cached) * 1e3})
    backend.pool.shutdown(wait=True)
    return {"backend_init_s": init_s, "repeats": repeats, "rows": rows}


# ---- (a) decode steps ----------------------------------------------------------------------

#: step kinds: (group, overlap scheduling forced off); "free-sync" is the free batch without
#: overlap (only where the scheduler overlaps), to split the constrained steps' extra time
#: into the overlap they give up and the grammar work itself
KINDS = {"free": ("free", False), "free-sync": ("free", True),
         "constrained": ("constrained", False), "mixed": ("mixed", False)}


def _use(sched, group: list[Req]) -> None:
    """Make ``group`` the scheduler's running set (the step in flight read back first)."""
    sched._drain()
    dev.synchronize(sched.runner.device_type)
    sched.running = list(group)


def _block(sched, group: list[Req], n: int, times: list[float] | None,
           sync: bool = False) -> None:
    """``n`` steps of ``group``, timed into ``times`` when given (with overlap scheduling
    after one untimed step that fills the pipeline); checks that each is a decode step of
    the whole group. ``sync``: overlap scheduling off for the block."""
    _use(sched, group)
    overlap = sched.overlap
    sched.overlap = overlap and not sync
    try:
        _steps(sched, group, n, times)
    finally:
        sched.overlap = overlap


def _steps(sched, group: list[Req], n: int, times: list[float] | None) -> None:
    before = [len(r.output_ids) for r in group]
    pre = sched.stats["preemptions"]
    skip = 1 if sched.overlap else 0
    for i in range(n + skip):
        if sched.waiting or sched.chunked is not None or len(sched.running) != len(group):
            raise RuntimeError("a timed step would not be a decode step of the whole batch")
        t0 = time.perf_counter()
        sched.step()
        if times is not None and i >= skip:
            times.append(time.perf_counter() - t0)
    sched._drain()
    done = [r.rid for r in group if r.finished]
    if done:
        reasons = {r.finished_reason.type for r in group if r.finished}
        raise RuntimeError(f"{len(done)} requests finished inside the run ({reasons}); the "
                           "constrained ones must not complete LONG_SCHEMA")
    if sched.stats["preemptions"] != pre:
        raise RuntimeError("requests were preempted (KV pool too small)")
    if any(len(r.output_ids) - b != n + skip for r, b in zip(group, before)):
        raise RuntimeError("a step did not add one token to every request")


def _grammar_host_times(llm, group: list[Req], repeats: int = 20) -> dict:
    """One step's mask work on the group's matchers as they are now (not advanced): the
    host fill and the apply on the logits' device (medians); off the CPU, the device's
    masked logits are checked against xgrammar's CPU kernel."""
    import torch

    from engine.sampling.grammar import apply_vocab_mask, fill_vocab_mask

    states = [r.grammar for r in group]
    V = llm.vocab_size
    runner = llm.runner
    fill, apply = [], []
    x0 = torch.randn(len(group), V, generator=torch.Generator().manual_seed(0))
    x = x0.to(runner.device)
    for _ in range(repeats):
        t0 = time.perf_counter()
        mask = fill_vocab_mask(states, V)
        fill.append(time.perf_counter() - t0)
        with _Timer(runner.device_type) as t:
            apply_vocab_mask(x, *mask)
        apply.append(t.elapsed)
    out = {"fill_ms": statistics.median(fill) * 1e3, "apply_ms": statistics.median(apply) * 1e3}
    if x.device.type != "cpu":
        from engine.sampling.grammar import _DEVICE_KERNEL

        out["apply_path"] = ("xgrammar triton" if _DEVICE_KERNEL.get(x.device.type)
                             else "torch (apply_vocab_mask_torch)")
        ref = x0.clone()
        apply_vocab_mask(ref, *mask)
        out["device_mask_matches_cpu"] = bool(torch.equal(x.cpu(), ref))
        if not out["device_mask_matches_cpu"]:
            raise RuntimeError("the device's masked logits differ from xgrammar's CPU kernel")
    return out


def _profile(sched, groups: dict, n: int, top: int = 12) -> dict:
    """cProfile of ``n`` more free and constrained steps: the functions with the most own
    time, then the sampling and grammar functions by cumulative time."""
    out = {}
    for kind in ("free", "constrained"):
        prof = cProfile.Profile()
        prof.enable()
        _block(sched, groups[kind], n, None)
        prof.disable()
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(top)
        st.sort_stats("cumulative").print_stats(r"grammar|sampl|_process|_launch|step")
        out[kind] = s.getvalue()
    return out


def max_new_tokens(bs: int, input_len: int, steps: int, block: int, warmup: int,
                   profile_steps: int) -> int:
    """Tokens a request of ``decode_steps`` may generate: the warm-up, timed and profiled
    blocks of the (at most three) kinds it is part of, the steps while the others prefill
    (at least one request, or a 64-token chunk, per step), and some slack."""
    per_kind = warmup + 1 + math.ceil(steps / block) * (block + 1) + profile_steps + 1
    return 3 * per_kind + 2 * bs * math.ceil(input_len / 64) + 64


def decode_steps(llm, bs: int, input_len: int, steps: int, block: int, warmup: int,
                 seed: int, mixed: bool, profile_steps: int = 0) -> dict:
    """(a): median scheduler step time of each kind at batch size ``bs``."""
    sched = llm.scheduler
    rng = random.Random(seed)
    kinds = [k for k in KINDS if (k != "mixed" or mixed) and (k != "free-sync" or sched.overlap)]
    rounds = math.ceil(steps / block)
    max_new = max_new_tokens(bs, input_len, steps, block, warmup, profile_steps)
    schema = json.dumps(LONG_SCHEMA)

    def make(tag: str, constrained: bool) -> list[Req]:
        return [Req(f"bench-grammar-{tag}-{i}",
                    [rng.randrange(llm.vocab_size) for _ in range(input_len)],
                    SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True,
                                   json_schema=schema if constrained else None),
                    max_new_tokens=max_new) for i in range(bs)]

    cons, free = make("c", True), make("f", False)
    # constrained first: their grammar compiles while nothing else runs
    for r in cons:
        sched.add_request(r)
    while len(sched.grammars) or sched.waiting or sched.chunked is not None:
        sched.step()
    for r in free:
        sched.add_request(r)
    while sched.waiting or sched.chunked is not None:
        sched.step()
    sched._drain()
    groups = {"free": free, "constrained": cons,
              "mixed": free[: bs // 2] + cons[: bs - bs // 2]}
    # per kind, per round: the step times of that round's block
    per_round: dict[str, list[list[float]]] = {k: [] for k in kinds}
    try:
        for kind in kinds:
            _block(sched, groups[KINDS[kind][0]], warmup, None, KINDS[kind][1])
        for _ in range(rounds):
            for kind in kinds:
                per_round[kind].append([])
                _block(sched, groups[KINDS[kind][0]], block, per_round[kind][-1],
                       KINDS[kind][1])
        host = _grammar_host_times(llm, cons)
        prof = _profile(sched, groups, profile_steps) if profile_steps else None
    finally:
        sched._drain()
        sched.running = [r for r in cons + free if not r.finished]
        for r in cons + free:
            sched.abort_request(r.rid)
        while sched.has_work():
            sched.step()
    times = {k: [t for r in per_round[k] for t in r] for k in kinds}
    res = {k: {"steps": len(times[k]), "median_step_s": statistics.median(times[k]),
               "mean_step_s": statistics.fmean(times[k]),
               "p10_step_s": _quantile(times[k], 0.1), "p90_step_s": _quantile(times[k], 0.9),
               "tok_s": bs / statistics.median(times[k])} for k in kinds}

    def ratio(a: str, b: str) -> float:
        return res[a]["median_step_s"] / res[b]["median_step_s"]

    def paired(a: str, b: str) -> float:
        """Median over the rounds of (a's median step / b's) in the same round: load that
        changes slower than a round cancels out."""
        return statistics.median(statistics.median(x) / statistics.median(y)
                                 for x, y in zip(per_round[a], per_round[b]))

    out = {"decode": res, "grammar_host": host, "sample_output": _sample_text(llm, cons),
           "rounds": rounds, "ratio_constrained": ratio("constrained", "free"),
           "paired_ratio_constrained": paired("constrained", "free"),
           "constrained_tokens_min": min(len(r.output_ids) for r in cons)}
    if mixed:
        out["ratio_mixed"] = ratio("mixed", "free")
        out["paired_ratio_mixed"] = paired("mixed", "free")
    if "free-sync" in res:
        out["ratio_constrained_to_free_sync"] = ratio("constrained", "free-sync")
        out["ratio_free_sync_to_free"] = ratio("free-sync", "free")
    if prof is not None:
        out["profile"] = prof
    return out


def _quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[round(q * (len(xs) - 1))]


def _sample_text(llm, group: list[Req]) -> str:
    if llm.tokenizer is None:
        return ""
    return llm.tokenizer.decode(group[0].output_ids[:48])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ferry bench-grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None,
                   help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "gguf",
                                                              "dummy"))
    p.add_argument("--tokenizer-path", default=None,
                   help="tokenizer directory (a grammar needs one; default: the model's)")
    p.add_argument("--device", default="auto", choices=dev.DEVICE_CHOICES)
    p.add_argument("--dtype", default="auto", choices=dev.DTYPE_CHOICES)
    p.add_argument("--batch-size", type=int, default=None,
                   help="B (default: 64 on an accelerator, 8 on the CPU)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps of each kind")
    p.add_argument("--block", type=int, default=None,
                   help="timed steps of one kind before switching to the next kind (default: "
                        "8 on an accelerator, 4 on the CPU)")
    p.add_argument("--warmup-steps", type=int, default=4, help="untimed steps of each kind")
    p.add_argument("--no-mixed", action="store_true", help="skip the half-constrained batch")
    p.add_argument("--compile-repeats", type=int, default=5,
                   help="cold and cached compiles of each constraint (medians)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after timing, cProfile this many more free and constrained steps "
                        "and print the functions with the most own time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the results as one JSON object")
    ns = p.parse_args(argv)
    for name in ("input_len", "steps", "block", "compile_repeats"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")

    from engine.llm import LLM

    device_type = dev.resolve_device(ns.device)
    accel = dev.is_accelerator(device_type)
    bs = ns.batch_size or (64 if accel else 8)
    ns.block = ns.block or (8 if accel else 4)
    if bs < 2:
        p.error("--batch-size must be at least 2")
    per_req = ns.input_len + max_new_tokens(bs, ns.input_len, ns.steps, ns.block,
                                            ns.warmup_steps, ns.profile_steps) + 16
    llm = LLM(ns.model_path, load_format=ns.load_format, tokenizer_path=ns.tokenizer_path,
              device=device_type, dtype=ns.dtype, seed=ns.seed,
              max_running_requests=2 * bs, max_total_tokens=2 * bs * per_req)
    if llm.tokenizer is None:
        p.error("this model has no tokenizer; a grammar needs one (--tokenizer-path)")
    runner = llm.runner
    model = ns.model_path or "SmolLM2-135M-Instruct (embedded)"
    print(f"model={model} device={runner.device_type} ({dev.device_name(runner.device_type)}) "
          f"dtype={str(runner.dtype).replace('torch.', '')} vocab={llm.vocab_size} bs={bs} "
          f"overlap={llm.scheduler.overlap} graphs={runner.graph_runner is not None}")

    comp = compile_times(llm.tokenizer, llm.vocab_size, llm.scheduler.eos_ids,
                         ns.compile_repeats)
    dec = decode_steps(llm, bs, ns.input_len, ns.steps, ns.block, ns.warmup_steps, ns.seed,
                       not ns.no_mixed, ns.profile_steps)

    print(f"\ndecode step, bs={bs}, in={ns.input_len}, {dec['rounds']} rounds of {ns.block} "
          "steps per kind (medians over the timed steps)")
    print(f"{'batch':<12} {'steps':>5} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} "
          f"{'mean ms':>9} {'tok/s':>9} {'x free':>7}")
    free_med = dec["decode"]["free"]["median_step_s"]
    for kind, r in dec["decode"].items():
        print(f"{kind:<12} {r['steps']:>5} {r['median_step_s'] * 1e3:>10.3f} "
              f"{r['p10_step_s'] * 1e3:>8.3f} {r['p90_step_s'] * 1e3:>8.3f} "
              f"{r['mean_step_s'] * 1e3:>9.3f} {r['tok_s']:>9.1f} "
              f"{r['median_step_s'] / free_med:>7.3f}")
    gh = dec["grammar_host"]
    print(f"constrained/free = {dec['ratio_constrained']:.3f} (paired by round "
          f"{dec['paired_ratio_constrained']:.3f})"
          + (f", mixed/free = {dec['ratio_mixed']:.3f} (paired {dec['paired_ratio_mixed']:.3f})"
             if "ratio_mixed" in dec else "")
          + (f", constrained/free-sync = {dec['ratio_constrained_to_free_sync']:.3f}, "
             f"free-sync/free = {dec['ratio_free_sync_to_free']:.3f}"
             if "ratio_constrained_to_free_sync" in dec else ""))
    print(f"one step's mask: fill {gh['fill_ms']:.3f} ms (host), apply {gh['apply_ms']:.3f} ms"
          + (f" ({gh['apply_path']}, matches the CPU kernel)"
             if gh.get("device_mask_matches_cpu") else "")
          + f"; constrained requests at >= {dec['constrained_tokens_min']} tokens, none "
          "finished")
    print(f"a constrained output begins: {dec['sample_output']!r}")
    print(f"\ngrammar compile (GrammarBackend; init {comp['backend_init_s'] * 1e3:.0f} ms), "
          f"medians of {comp['repeats']}")
    print(f"{'constraint':<30} {'kind':<12} {'chars':>6} {'cold ms':>9} {'cached ms':>10}")
    for r in comp["rows"]:
        print(f"{r['name']:<30} {r['kind']:<12} {r['chars']:>6} {r['cold_ms']:>9.2f} "
              f"{r['cached_ms']:>10.4f}")
    for kind, text in (dec.get("profile") or {}).items():
        print(f"\n--- cProfile, {ns.profile_steps} {kind} steps ---\n{text}")

    if ns.result_file:
        res = {"model": model, "device": runner.device_type,
               "device_name": dev.device_name(runner.device_type),
               "dtype": str(runner.dtype).replace("torch.", ""), "vocab_size": llm.vocab_size,
               "batch_size": bs, "input_len": ns.input_len, "block": ns.block,
               "warmup_steps": ns.warmup_steps, "overlap": llm.scheduler.overlap,
               "graphs": runner.graph_runner is not None,
               **{k: v for k, v in dec.items() if k != "profile"}, "compile": comp}
        with open(ns.result_file, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
