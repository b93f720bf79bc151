"""``ferry quant-parity``: how far FP8 W8A8 (or 4-bit weights) moves a model from its float
version.

Runs the same prompts through the float model (the run dtype: fp32 on the CPU, bf16 on GPUs
by default) and through the FP8 version of the same weights (``--quantization fp8``, or an
FP8 checkpoint given as ``--fp8-model-path``; ``--quantization awq|gptq``: the same weights
in 4 bits, round to nearest in groups of 128), greedy, and reports per prompt:

- the mean KL divergence ``KL(p_ref || p_fp8)`` of the next-token distributions (float64
  log-softmax of the fp32 logits), teacher-forced: the FP8 model is fed the reference's
  greedy tokens, so both distributions of a step condition on the same context;
- greedy agreement: how many of the first ``--steps`` tokens the FP8 model generates before
  its greedy choice first differs from the reference's. Up to that step the FP8 model's own
  greedy run would have seen exactly the reference's tokens, so this is the first step
  where its teacher-forced argmax differs (one FP8 run gives both figures);
- the teacher-forced top-1 match rate (FP8's argmax equals the reference token, over all
  steps, also after a first difference).

Prompts: eight short English prompts when the model has a tokenizer (``--chat`` wraps them
in its chat template), else (dummy weights, or ``--random-prompts``) random token ids.
Examples::

    ferry quant-parity                                     # embedded SmolLM2, CPU, fp32 vs fp8
    ferry quant-parity --model-path engine/configs/llama-3-8b.json --load-format dummy \\
        --device cuda --steps 32                           # bf16 vs fp8 on a dummy 8B
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

from bench.bench_latency import _alloc
from bench.parity import greedy_trace
from engine import device as dev
from engine.args import ServerArgs
from engine.executor.schedule_batch import ScheduleBatch
from engine.forward_batch import ForwardMode
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain photosynthesis in one sentence.",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "List three prime numbers:",
    "Translate 'good morning' into Spanish:",
]


@torch.inference_mode()
def forced_trace(runner, prompts: list[list[int]], tokens: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced steps: step ``s`` of prompt ``i`` sees ``prompts[i] + tokens[i][:s]``.

    Returns one float32 CPU tensor ``[B, vocab]`` of logits per step (``len(tokens[0])``
    steps; step 0 is the prefill's last position).
    """
    reqs = []
    for i, ids in enumerate(prompts):
        r = Req(f"qparity-{i}", list(ids), SamplingParams(max_tokens=len(tokens[i]),
                                                          temperature=0))
        r.req_pool_idx = runner.req_to_token_pool.alloc()
        reqs.append(r)
    steps = len(tokens[0])
    out = []
    try:
        locs = []
        for r in reqs:
            locs += _alloc(runner, r, len(r.origin_input_ids))
        batch = ScheduleBatch(ForwardMode.EXTEND, reqs, [0] * len(reqs),
                              [len(r.origin_input_ids) for r in reqs], [True] * len(reqs), locs)
        for step in range(steps):
            out.append(runner.forward(batch).float().cpu())
            if step + 1 == steps:
                break
            for r, toks in zip(reqs, tokens):
                r.output_ids.append(toks[step])
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
    return out


def kl_per_step(ref: list[torch.Tensor], got: list[torch.Tensor]) -> torch.Tensor:
    """``KL(softmax(ref) || softmax(got))`` in float64 for every (prompt, step):
    ``[B, steps]``."""
    a = torch.stack(ref, dim=1).double().log_softmax(-1)
    b = torch.stack(got, dim=1).double().log_softmax(-1)
    return (a.exp() * (a - b)).sum(-1)


def make_prompts(ns, vocab: int) -> tuple[list[list[int]], str]:
    """Token ids of the prompts and what they are (``text``, ``chat`` or ``random``)."""
    tok = None
    if not ns.random_prompts and (ns.load_format != "dummy" or ns.tokenizer_path):
        from engine.tokenizer.tokenizer import load_tokenizer

        try:
            tok = load_tokenizer(ns.tokenizer_path or ns.model_path)
        except Exception:  # noqa: BLE001 - dummy weights without a tokenizer: random ids
            tok = None
    if tok is None:
        g = torch.Generator().manual_seed(ns.seed)
        return [torch.randint(0, vocab, (max(4, ns.prompt_len - 7 * i),), generator=g).tolist()
                for i in range(ns.num_prompts)], "random"
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(ns.num_prompts)]
    if ns.chat:
        chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                         add_generation_prompt=True) for t in texts]
        return [tok.encode(c, add_special_tokens=False) for c in chats], "chat"
    return [tok.encode(t) for t in texts], "text"


def _runner(ns, model_path, load_format, quantization):
    from engine.executor.model_runner import ModelRunner

    tokens = ns.num_prompts * (max(ns.prompt_len, 256) + ns.steps + 16)
    args = ServerArgs(model_path=model_path, load_format=load_format, dtype=ns.dtype,
                      device=ns.device, seed=ns.seed, quantization=quantization,
                      tp_size=ns.tp_size, cpu_threads=ns.cpu_threads, max_total_tokens=tokens,
                      max_running_requests=ns.num_prompts, disable_cuda_graph=True,
                      disable_piecewise_graph=True)
    return ModelRunner(args)


def _release(runner) -> None:
    device_type = runner.device_type
    runner.shutdown()
    del runner
    gc.collect()
    dev.empty_cache(device_type)


def run(ns) -> dict:
    """Both runs and the report (a dict; ``rows`` has one entry per prompt)."""
    ref = _runner(ns, ns.model_path, ns.load_format, None)
    prompts, kind = make_prompts(ns, ref.vocab_size)
    dtype = str(ref.dtype).removeprefix("torch.")
    ref_toks, ref_logits = greedy_trace(ref, prompts, ns.steps)
    _release(ref)
    if ns.fp8_model_path:  # an FP8 checkpoint (its format from the path)
        fp8 = _runner(ns, ns.fp8_model_path, "auto", "fp8")
    else:
        fp8 = _runner(ns, ns.model_path, ns.load_format, ns.quantization)
    forced = forced_trace(fp8, prompts, ref_toks)
    device_type = fp8.device_type
    _release(fp8)
    kl = kl_per_step(ref_logits, forced)
    top1 = torch.stack([f.argmax(-1) for f in forced], dim=1) == torch.tensor(ref_toks)
    rows = []
    for i in range(len(prompts)):
        miss = (~top1[i]).nonzero()
        agreed = int(miss[0, 0]) if len(miss) else ns.steps
        rows.append({"prompt": i, "prompt_tokens": len(prompts[i]), "steps": ns.steps,
                     "steps_agreed": agreed, "mean_kl": float(kl[i].mean()),
                     "max_kl": float(kl[i].max()), "top1_match": float(top1[i].float().mean())})
    full = sum(r["steps_agreed"] == r["steps"] for r in rows)
    return {"model": ns.model_path or "SmolLM2-135M-Instruct (embedded)",
            "fp8_model": ns.fp8_model_path or f"same weights, --quantization {ns.quantization}",
            "quantization": "fp8" if ns.fp8_model_path else ns.quantization,
            "device": device_type, "reference_dtype": dtype, "prompts": kind,
            "num_prompts": len(rows), "steps": ns.steps,
            "prompts_fully_agreed": full,
            "median_steps_agreed": statistics.median(r["steps_agreed"] for r in rows),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "top1_match": float(top1.float().mean()), "rows": rows}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferry quant-parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None,
                   help="the float model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--fp8-model-path", default=None,
                   help="an FP8 checkpoint of the same model (default: the float model with "
                        "--quantization fp8)")
    p.add_argument("--quantization", default="fp8", choices=("fp8", "awq", "gptq"),
                   help="how the same weights are quantized (without --fp8-model-path): FP8 "
                        "W8A8, or 4-bit weights (awq: asymmetric, gptq: symmetric groups)")
    p.add_argument("--load-format", default="auto", help="auto, safetensors, gguf or dummy")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer for the text prompts")
    p.add_argument("--device", default="auto", choices=dev.DEVICE_CHOICES)
    p.add_argument("--dtype", default="auto", choices=dev.DTYPE_CHOICES,
                   help="run dtype of both models (auto: fp32 on the CPU, bf16 on GPUs)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="intra-op CPU threads (default: as ferry serve's --cpu-threads)")
    p.add_argument("--steps", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts (default: 8)")
    p.add_argument("--prompt-len", type=int, default=48,
                   help="tokens of the longest random prompt (default: 48)")
    p.add_argument("--random-prompts", action="store_true",
                   help="random token ids even when the model has a tokenizer")
    p.add_argument("--chat", action="store_true", help="wrap the prompts in the chat template")
    p.add_argument("--seed", type=int, default=0, help="weights (dummy) and random prompts")
    p.add_argument("--result-json", default=None, help="write the report as JSON here")
    return p


def main(argv: list[str] | None = None) -> dict:
    ns = parser().parse_args(argv)
    if ns.steps < 1 or ns.num_prompts < 1:
        parser().error("--steps and --num-prompts must be >= 1")
    dev.set_cpu_threads(dev.cpu_thread_count(ns.cpu_threads))
    rep = run(ns)
    what = {"fp8": "FP8 W8A8", "awq": "AWQ-style 4-bit", "gptq": "GPTQ-style 4-bit"}
    print(f"{rep['model']}: {rep['reference_dtype']} vs {what[rep['quantization']]} on "
          f"{rep['device']}, "
          f"{rep['num_prompts']} {rep['prompts']} prompts x {rep['steps']} greedy steps")
    for r in rep["rows"]:
        print(f"  prompt {r['prompt']} ({r['prompt_tokens']} tok): agreed "
              f"{r['steps_agreed']}/{r['steps']}, mean KL {r['mean_kl']:.2e}, max KL "
              f"{r['max_kl']:.2e}, teacher-forced top-1 {r['top1_match']:.2f}")
    print(f"fully agreed {rep['prompts_fully_agreed']}/{rep['num_prompts']} prompts, median "
          f"{rep['median_steps_agreed']} steps; mean KL {rep['mean_kl']:.3e} (max "
          f"{rep['max_kl']:.3e}); teacher-forced top-1 {rep['top1_match']:.3f}")
    summary = {k: v for k, v in rep.items() if k != "rows"}
    print(json.dumps(summary))
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump(rep, f, indent=1)
    return rep


if __name__ == "__main__":
    main()
