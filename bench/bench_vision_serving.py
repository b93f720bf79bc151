"""ferry bench-vision-serving: serving load with images vs the same load of text (issue 48).

An open-loop load, in-process (the offline engine's scheduler, no HTTP: a dummy-weight
config has no tokenizer or image processor to serve through the API): ``--num-requests``
requests arrive at ``--request-rate`` per second (exponential gaps, seeded), each ``--text-len``
random text tokens around one synthetic ``--image-size`` image (``bench.bench_vision``'s:
random pixels on the tower's patch grid, a distinct content hash per request, so the prefix
cache never shares an image), and generate ``--output-len`` tokens (``ignore_eos``). Then the
same arrivals with text-only prompts of the same length (text tokens in place of the image
tokens). Per load: TTFT (arrival to the first token) and ITL (the gaps between a request's
tokens) medians and p99, output tokens/s and requests/s over the load's span (first arrival
to last token). One JSON line per load (``load``: ``image`` or ``text``).

``--model-path engine/configs/qwen2.5-vl-7b-instruct.json --load-format dummy`` on a GPU is
the ``vision-serving`` stage of ``bench/h200_run.sh``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import msgspec
import torch

from bench.bench_vision import dummy_image, image_llm
from bench.result_line import emit_result
from bench.serving.serving_report import percentile
from engine.sampling.params import SamplingParams
from engine.scheduler.request import Req
from engine.validation import images_for
from server.cli import add_engine_args


def _prompts(model, ns) -> tuple[list[tuple[list[int], list]], list[tuple[list[int], list]]]:
    """Per request: (ids, [image]) with one image, and (ids, []) text of the same length."""
    half = ns.text_len // 2
    base = dummy_image(model, ns.image_size, half)
    vocab = model.model_config.vocab_size
    g = torch.Generator().manual_seed(ns.seed)
    with_image, text_only = [], []
    for i in range(ns.num_requests):
        text = torch.randint(10, min(1000, vocab), (ns.text_len + base.length,),
                             generator=g).tolist()
        image = msgspec.structs.replace(base, content_hash=1000 + i)
        with_image.append((text[:half] + [model.image_token_id] * base.length
                           + text[half:ns.text_len], [image]))
        text_only.append((text, []))
    return with_image, text_only


def run_load(llm, prompts: list, gaps: list[float], output_len: int) -> dict:
    """Serve ``prompts`` arriving ``gaps`` seconds apart; TTFT/ITL/throughput (seconds)."""
    sched, model = llm.scheduler, llm.runner.model
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    arrivals, t = [], 0.0
    for gap in gaps:
        t += gap
        arrivals.append(t)
    live: list[tuple[Req, float, list[float]]] = []   # (request, arrival, token times)
    done: list[tuple[Req, float, list[float]]] = []
    start = time.perf_counter()
    nxt = 0
    while nxt < len(prompts) or live:
        now = time.perf_counter() - start
        while nxt < len(prompts) and arrivals[nxt] <= now:
            ids, images = prompts[nxt]
            req = Req(f"vs-{id(prompts)}-{nxt}", ids, sp, False, output_len)
            if images:
                req.set_images(images_for(model, images, len(ids)))
            sched.add_request(req)
            live.append((req, start + arrivals[nxt], []))
            nxt += 1
        if not live:
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        sched.step()
        t_now = time.perf_counter()
        for req, _, times in live:
            times.extend([t_now] * (len(req.output_ids) - len(times)))
        done += [x for x in live if x[0].finished]
        live = [x for x in live if not x[0].finished]
    end = max(times[-1] for _, _, times in done)
    ttft = [times[0] - t0 for _, t0, times in done]
    itl = [b - a for _, _, times in done for a, b in zip(times, times[1:])]
    span = end - (start + arrivals[0])
    return {"requests": len(done), "ttft_median_s": statistics.median(ttft),
            "ttft_p99_s": percentile(ttft, 99), "itl_median_s": statistics.median(itl),
            "itl_p99_s": percentile(itl, 99),
            "output_tok_s": sum(len(times) for _, _, times in done) / span,
            "req_s": len(done) / span}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ferry bench-vision-serving", description=__doc__)
    p.add_argument("--image-size", type=int, default=1024, help="pixels a side (default 1024)")
    p.add_argument("--text-len", type=int, default=100, help="text tokens (default 100)")
    p.add_argument("--output-len", type=int, default=64, help="tokens per request (64)")
    p.add_argument("--num-requests", type=int, default=60, help="requests per load (60)")
    p.add_argument("--request-rate", type=float, default=4.0, help="arrivals per s (4)")
    p.add_argument("--result-jsonl", default=None, help="append one JSON line per load")
    add_engine_args(p)
    ns = p.parse_args(argv)
    llm = image_llm(ns)
    model = llm.runner.model
    with_image, text_only = _prompts(model, ns)
    rng = random.Random(ns.seed)
    gaps = [0.0] + [rng.expovariate(ns.request_rate) for _ in range(ns.num_requests - 1)]
    # warm-up: two of each, back to back (kernels compiled, graphs and allocator warm)
    run_load(llm, with_image[:2] + text_only[:2], [0.0] * 4, 4)
    for load, prompts in (("image", with_image), ("text", text_only)):
        llm.scheduler.flush_cache()
        res = {"load": load, "image_size": ns.image_size, "prompt_tokens": len(prompts[0][0]),
               "text_tokens": ns.text_len if load == "image" else len(prompts[0][0]),
               "output_len": ns.output_len, "request_rate": ns.request_rate,
               "tp_size": ns.tp_size, "device": llm.runner.device_type,
               **run_load(llm, prompts, gaps, ns.output_len)}
        emit_result(res, f"{load:5s} load: {res['requests']} req at {ns.request_rate:g}/s, "
                    f"{res['prompt_tokens']} prompt tokens | TTFT median "
                    f"{res['ttft_median_s'] * 1e3:.1f} ms p99 {res['ttft_p99_s'] * 1e3:.1f} ms"
                    f" | ITL median {res['itl_median_s'] * 1e3:.1f} ms p99 "
                    f"{res['itl_p99_s'] * 1e3:.1f} ms | {res['output_tok_s']:.0f} tok/s, "
                    f"{res['req_s']:.2f} req/s", ns.result_jsonl)
    llm.shutdown()


if __name__ == "__main__":
    main()
