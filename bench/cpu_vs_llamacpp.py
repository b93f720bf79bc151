"""CPU decode benchmark: ferry against llama.cpp (llama-cpp-python) on the same GGUF file,
with the same thread count on the same machine (issue 30's targets: bs1 >= 0.8x llama.cpp,
bs8 >= 1.0x).

    python -m bench.cpu_vs_llamacpp [--threads N] [--reps 3] [--input-len 128]
                                    [--output-len 64] [--model FILE.gguf] [--out DIR]

Needs llama-cpp-python, which ferry never depends on and this script never installs. It has
no CPU wheel on PyPI; its sdist compiles llama.cpp with cmake (~10 min on 2 cores)::

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # plus: pip install diskcache

Two subprocesses, one after the other (never at the same time):

1. llama.cpp (``--part llama``, this file): ``llama_cpp.Llama`` loads the file (n_threads =
   n_threads_batch = N, n_seq_max = 8, n_ctx = 8 x 256, its other defaults); then per rep
   and batch size B in (1, 8): clear the KV memory, prefill B prompts of ``--input-len``
   random token ids (B sequence ids, one ``llama_decode`` per prompt), then ``--output-len``
   - 1 greedy decode steps, each one ``llama_decode`` of a B-token batch (token b in sequence
   b at its next position, logits for all B) plus the argmax of the B logit rows in numpy.
   Each step is timed with the host clock; a rep's figure is the median step.
2. ferry: ``python -m bench.bench_latency --batch-size 1 8 (x reps) --input-len ...
   --output-len ... --cpu-threads N --result-jsonl ...`` (the default path: Q4_1 blocks,
   fp32 activations; its median decode step per run: forward plus argmax, host clock), with
   OMP_WAIT_POLICY=PASSIVE unless set, as ``ferry bench-latency`` and ``ferry serve`` run.

The table gives the median over the reps of each one's median step (ms) and tok/s (B / step),
and ferry's tok/s over llama.cpp's. ``uptime`` and the /proc/stat busy share over 2 s are
printed before each part: other processes on the machine move both sides' figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BATCH_SIZES = (1, 8)


def _busy_pct(dt: float = 2.0) -> float:
    """The share (%) of CPU time not idle over ``dt`` seconds, from /proc/stat."""
    def snap():
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = snap()
    time.sleep(dt)
    t1, i1 = snap()
    return 100.0 * (1 - (i1 - i0) / max(1, t1 - t0))


def machine_load() -> str:
    """``uptime``'s load averages and the busy share now (one line)."""
    la = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return f"load average {la}; busy {_busy_pct():.0f}% over 2 s"


def default_model() -> str:
    from engine.loader.loader import default_model_file

    return default_model_file()


# --------------------------------------------------------------------------- llama.cpp part

def _llama_part(ns) -> None:
    import llama_cpp as lc
    import numpy as np

    max_b = max(BATCH_SIZES)
    per_seq = ns.input_len + ns.output_len + 8
    if not ns.verbose:  # llama.cpp's load log on stderr: only warnings and errors
        def _log(level, text, _user):
            if level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR
                sys.stderr.write(text.decode(errors="replace"))
        ns._log_cb = lc.llama_log_callback(_log)  # kept alive while llama.cpp may call it
        lc.llama_log_set(ns._log_cb, None)
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(ns.model.encode(), mp)
    cp = lc.llama_context_default_params()  # llama.cpp's defaults otherwise (flash attn: auto)
    cp.n_ctx = max_b * per_seq
    cp.n_batch = cp.n_ubatch = max(ns.input_len, max_b)
    cp.n_seq_max = max_b
    cp.n_threads = cp.n_threads_batch = ns.threads
    ctx = lc.llama_init_from_model(model, cp)
    if not model or not ctx:
        raise RuntimeError(f"llama.cpp could not load {ns.model}")
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    mem = lc.llama_get_memory(ctx) if hasattr(lc, "llama_get_memory") else None
    batch = lc.llama_batch_init(max(ns.input_len, max_b), 0, 1)
    rng = np.random.default_rng(0)

    def clear():
        if mem is not None:
            lc.llama_memory_clear(mem, True)
        else:  # older llama-cpp-python
            lc.llama_kv_self_clear(ctx)

    def decode(tokens, positions, seqs, logits_all):
        n = len(tokens)
        for i in range(n):
            batch.token[i] = int(tokens[i])
            batch.pos[i] = int(positions[i])
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = int(seqs[i])
            batch.logits[i] = bool(logits_all or i == n - 1)
        batch.n_tokens = n
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax_rows(rows):
        out = []
        for i in rows:
            p = lc.llama_get_logits_ith(ctx, i)
            out.append(int(np.argmax(np.ctypeslib.as_array(p, shape=(vocab,)))))
        return out

    results = []
    for rep in range(ns.reps + 1):  # rep 0: warm-up, not reported
        for b in BATCH_SIZES:
            clear()
            nxt = []
            for s in range(b):
                prompt = rng.integers(0, vocab, ns.input_len)
                decode(prompt, range(ns.input_len), [s] * ns.input_len, False)
                nxt += argmax_rows([ns.input_len - 1])
            steps = []
            n_steps = ns.output_len - 1 if rep else min(ns.output_len - 1, 4)
            for k in range(n_steps):
                t0 = time.perf_counter()
                decode(nxt, [ns.input_len + k] * b, range(b), True)
                nxt = argmax_rows(range(b))
                steps.append(time.perf_counter() - t0)
            if rep:
                results.append({"engine": "llama.cpp", "batch_size": b,
                                "median_decode_latency_s": statistics.median(steps)})
                print(f"llama.cpp rep {rep} bs={b}: median step "
                      f"{1e3 * results[-1]['median_decode_latency_s']:.2f} ms", flush=True)
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    info = {"llama_cpp_python": getattr(lc, "__version__", "?"),
            "flash_attn_type": int(cp.flash_attn_type),
            "system_info": lc.llama_print_system_info().decode(errors="replace").strip()}
    with open(ns.result_jsonl, "a") as f:
        for r in results:
            f.write(json.dumps({**r, **info}) + "\n")


# --------------------------------------------------------------------------------- driver

def _run(cmd: list[str], env: dict) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env=env)


def _median_by_bs(rows: list[dict]) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for r in rows:
        by.setdefault(int(r["batch_size"]), []).append(float(r["median_decode_latency_s"]))
    return {b: statistics.median(v) for b, v in by.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.cpu_vs_llamacpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads for both (ferry --cpu-threads; llama.cpp n_threads); "
                        "default: all cores")
    p.add_argument("--reps", type=int, default=3, help="timed runs per batch size (default 3)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model", default=None, help="GGUF file (default: ferry's embedded model)")
    p.add_argument("--out", default=None, help="folder for the result JSON lines (default: a "
                                               "temporary one)")
    p.add_argument("--skip", choices=["llama", "ferry"], default=None,
                   help="leave one side out (its column shows n/a)")
    p.add_argument("--verbose", action="store_true", help="llama.cpp's full load log")
    p.add_argument("--part", choices=["llama"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-jsonl", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    ns.model = ns.model or default_model()
    if ns.part == "llama":
        _llama_part(ns)
        return
    out = Path(ns.out or tempfile.mkdtemp(prefix="cpu_vs_llamacpp-"))
    out.mkdir(parents=True, exist_ok=True)
    lj, fj = out / "llama.jsonl", out / "ferry.jsonl"
    for f in (lj, fj):
        f.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(ns.threads))
    common = ["--input-len", str(ns.input_len), "--output-len", str(ns.output_len)]
    loads = {}
    if ns.skip != "llama":
        loads["llama.cpp"] = machine_load()
        print("before llama.cpp:", loads["llama.cpp"], flush=True)
        _run([sys.executable, "-m", "bench.cpu_vs_llamacpp", "--part", "llama", "--model",
              ns.model, "--threads", str(ns.threads), "--reps", str(ns.reps),
              "--result-jsonl", str(lj)] + common + (["--verbose"] if ns.verbose else []), env)
    if ns.skip != "ferry":
        loads["ferry"] = machine_load()
        print("before ferry:", loads["ferry"], flush=True)
        model_args = [] if ns.model == default_model() else ["--model-path", ns.model]
        _run([sys.executable, "-m", "bench.bench_latency", "--batch-size",
              *[str(b) for _ in range(ns.reps) for b in BATCH_SIZES], *common,
              "--cpu-threads", str(ns.threads), "--result-jsonl", str(fj)] + model_args,
             {"OMP_WAIT_POLICY": "PASSIVE", **env})  # as `ferry bench-latency` sets it
    read = (lambda f: [json.loads(ln) for ln in f.read_text().splitlines()]
            if f.exists() else [])
    lrows, frows = read(lj), read(fj)
    lmed, fmed = _median_by_bs(lrows), _median_by_bs(frows)
    print(f"\nmodel {ns.model}\nthreads {ns.threads}, prompt {ns.input_len} random tokens, "
          f"{ns.output_len} output tokens, greedy; medians over {ns.reps} reps of each run's "
          "median decode step")
    if lrows:
        print(f"llama-cpp-python {lrows[0]['llama_cpp_python']}: {lrows[0]['system_info']}")
    for k, v in loads.items():
        print(f"before {k}: {v}")
    print("\n| batch | llama.cpp step | llama.cpp tok/s | ferry step | ferry tok/s | "
          "ferry / llama.cpp |\n|---|---|---|---|---|---|")
    for b in BATCH_SIZES:
        lm, fm = lmed.get(b), fmed.get(b)
        cell = (lambda s, b=b: (f"{1e3 * s:.2f} ms", f"{b / s:.1f}") if s else ("n/a", "n/a"))
        ratio = f"{lm / fm:.2f}x" if lm and fm else "n/a"
        print(f"| {b} | {' | '.join(cell(lm))} | {' | '.join(cell(fm))} | {ratio} |")
    print(f"\nraw results: {out}")


if __name__ == "__main__":
    main()
