"""The HF transformers baseline for ``ferry bench-latency``: the same shapes through
``model.generate`` with random weights, plus the bandwidth roofline, side by side.

    python -m bench.hf_baseline --model-path engine/configs/llama-3-8b.json \\
        --batch-size 1 64 --input-len 512 --output-len 64 --ferry-jsonl ferry.jsonl

The model is built from a config (a ``config.json`` file or a directory holding one; nothing
is downloaded) with
``AutoModelForCausalLM.from_config`` on the device, SDPA attention, and seeded small normal
weights. Each configuration runs one static batch of random prompts, greedy, with
``min_new_tokens = max_new_tokens`` so EOS never stops it early. Timing (device events or a
synchronised host clock, median of ``--runs`` after a warm-up):

- prefill latency: ``generate(max_new_tokens=1)``;
- total latency: ``generate(max_new_tokens=output_len)``;
- decode step latency: ``(total - prefill) / (output_len - 1)``; decode tok/s = bs / step.

The roofline (bench.roofline) is weights plus the batch's KV cache at the mean decode
context, read once per step at the measured copy bandwidth; "fraction" is roofline step time
over measured step time (1.0 = at the bandwidth limit). ``--ferry-jsonl`` reads the lines of
``ferry bench-latency --result-jsonl`` and prints ferry/HF ratios per matching shape.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from bench import roofline
from engine import device as dev


def _time_s(device_type: str, fn) -> float:
    """Seconds of ``fn()``: device events on accelerators, synchronised ``perf_counter`` on
    the CPU."""
    ev = dev.event_class(device_type)
    dev.synchronize(device_type)
    if ev is not None:
        a, b = ev(enable_timing=True), ev(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t0 = time.perf_counter()
    fn()
    dev.synchronize(device_type)
    return time.perf_counter() - t0


def build_model(model_path: str, device_type: str, dtype: torch.dtype, seed: int = 0):
    """An HF causal LM from the config ``model_path`` (file or directory), on ``device_type`` in ``dtype``,
    SDPA attention, eval mode. Weights: matrices N(0, 0.02), norm weights 1, biases 0 (seeded),
    so activations stay finite. Returns ``(model, config)``.

    Raises:
        FileNotFoundError: no ``config.json`` in ``model_path``.
    """
    from transformers import AutoModelForCausalLM

    config = roofline.load_config(model_path)
    with torch.device(device_type):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    g = torch.Generator(device=device_type).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=g)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    model.eval()
    gc = model.generation_config
    gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else 0
    return model, config


def run_shape(model, device_type: str, bs: int, input_len: int, output_len: int,
              runs: int = 3, warmup: int = 1, seed: int = 0,
              cache_implementation: str | None = None) -> dict:
    """Time one (batch size, input len, output len) shape through ``model.generate``.

    Returns seconds (medians over ``runs``): ``prefill_latency_s``, ``total_latency_s``,
    ``median_decode_latency_s`` ((total - prefill) / (output_len - 1), NaN for output_len 1),
    and the throughputs in tok/s (prefill: input tokens; decode: output tokens per step).

    Raises:
        ValueError: a length or count below 1.
    """
    if min(bs, input_len, output_len, runs) < 1:
        raise ValueError("batch size, lengths and runs must be >= 1")
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (bs, input_len), generator=g).to(device_type)
    mask = torch.ones_like(ids)

    def gen(n: int):
        kw = {"cache_implementation": cache_implementation} if cache_implementation else {}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, use_cache=True, **kw)
        if out.shape != (bs, input_len + n):
            raise RuntimeError(f"generate returned {tuple(out.shape)}, "
                               f"expected {(bs, input_len + n)}")

    for _ in range(warmup):
        gen(1)
        gen(min(output_len, 4))
    prefill = statistics.median(_time_s(device_type, lambda: gen(1)) for _ in range(runs))
    total = statistics.median(_time_s(device_type, lambda: gen(output_len))
                              for _ in range(runs))
    step = (total - prefill) / (output_len - 1) if output_len > 1 else float("nan")
    return {
        "batch_size": bs, "input_len": input_len, "output_len": output_len,
        "prefill_latency_s": prefill, "prefill_throughput_tok_s": bs * input_len / prefill,
        "median_decode_latency_s": step,
        "median_decode_throughput_tok_s": _div(bs, step) if step > 0 else float("nan"),
        "total_latency_s": total,
        "total_throughput_tok_s": bs * (input_len + output_len) / total,
    }


def _div(a: float | None, b: float | None) -> float:
    """a / b; NaN where b is 0 or either side is missing (None) or not finite."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return float("nan")
    return a / b


def _json_safe(obj):
    """NaN/inf -> None (strict JSON lines)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    return obj


def compare(hf: dict, ferry: dict, roofline_step_s: float) -> dict:
    """ferry vs HF on one shape (rows with bench-latency's field names).

    Returns ``prefill_speedup`` (HF prefill latency / ferry's), ``decode_speedup`` (ferry decode
    tok/s / HF's), and each side's fraction of the decode roofline (roofline step time /
    measured decode step time; 1.0 = at the bandwidth limit).
    """
    div = _div
    return {
        "prefill_speedup": div(hf["prefill_latency_s"], ferry["prefill_latency_s"]),
        "decode_speedup": div(ferry["median_decode_throughput_tok_s"],
                              hf["median_decode_throughput_tok_s"]),
        "hf_roofline_fraction": div(roofline_step_s, hf["median_decode_latency_s"]),
        "ferry_roofline_fraction": div(roofline_step_s, ferry["median_decode_latency_s"]),
    }


def read_ferry_jsonl(path: str) -> dict[tuple[int, int, int], dict]:
    """ferry bench-latency lines keyed by ``(batch_size, input_len, output_len)``; a later line
    for the same shape replaces an earlier one. Blank lines are skipped.

    Raises:
        ValueError: a line that is not JSON or lacks the shape fields.
    """
    rows = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rows[(int(r["batch_size"]), int(r["input_len"]), int(r["output_len"]))] = r
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a bench-latency result line ({e})") from e
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """Entry point; returns the result rows (also printed, and appended to ``--result-jsonl``)."""
    p = argparse.ArgumentParser(prog="python -m bench.hf_baseline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a dir with config.json")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, nargs="+", default=[512])
    p.add_argument("--output-len", type=int, nargs="+", default=[64])
    p.add_argument("--device", default="auto", choices=dev.DEVICE_CHOICES)
    p.add_argument("--dtype", default="bfloat16", choices=dev.DTYPE_CHOICES)
    p.add_argument("--runs", type=int, default=3, help="timed runs per shape (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-implementation", default=None,
                   help="passed to generate (e.g. static); default: HF's dynamic cache")
    p.add_argument("--bandwidth-mib", type=int, default=None,
                   help="copy buffer for the bandwidth test (default 2048 on GPUs, 256 on CPU)")
    p.add_argument("--ferry-jsonl", default=None, help="ferry bench-latency --result-jsonl file")
    p.add_argument("--result-jsonl", default=None, help="append one JSON line per shape")
    ns = p.parse_args(argv)

    device_type = dev.resolve_device(ns.device)
    dtype = dev.resolve_dtype(ns.dtype, device_type)
    dtype_name = str(dtype).replace("torch.", "")
    ferry_rows = read_ferry_jsonl(ns.ferry_jsonl) if ns.ferry_jsonl else {}
    mib = ns.bandwidth_mib or (2048 if dev.is_accelerator(device_type) else 256)
    bandwidth = roofline.measure_bandwidth(device_type, mib << 20)
    model, config = build_model(ns.model_path, device_type, dtype, ns.seed)
    wbytes = roofline.weight_bytes(model)
    kv_tok = roofline.config_kv_bytes_per_token(config.get_text_config(), dtype.itemsize)
    bs1_step, bs1_tok_s = roofline.decode_roofline(wbytes, 0, bandwidth, 1)
    print(f"hf baseline: model={ns.model_path} device={device_type} "
          f"({dev.device_name(device_type)}) dtype={dtype_name} attn=sdpa")
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s | weights {wbytes / 1e9:.4g} GB | "
          f"bs1 decode roofline {bs1_step * 1e3:.3f} ms/step ({bs1_tok_s:.1f} tok/s)")

    results = []
    for bs in ns.batch_size:
        for il in ns.input_len:
            for ol in ns.output_len:
                r = run_shape(model, device_type, bs, il, ol, ns.runs, ns.warmup, ns.seed,
                              ns.cache_implementation)
                ctx = il + ol / 2  # mean KV length read per decode step
                step, _ = roofline.decode_roofline(wbytes, bs * ctx * kv_tok, bandwidth, bs)
                r.update({"impl": "hf", "device": device_type, "dtype": dtype_name,
                          "bandwidth_bytes_s": bandwidth, "weight_bytes": wbytes,
                          "roofline_decode_latency_s": step,
                          "hf_roofline_fraction": _div(step, r["median_decode_latency_s"])})
                print(f"HF    bs={bs} in={il} out={ol} | prefill {r['prefill_latency_s']:.4f} s "
                      f"({r['prefill_throughput_tok_s']:.0f} tok/s) | decode "
                      f"{r['median_decode_latency_s'] * 1e3:.3f} ms/step "
                      f"({r['median_decode_throughput_tok_s']:.1f} tok/s) | roofline "
                      f"{step * 1e3:.3f} ms/step, HF at {r['hf_roofline_fraction']:.1%}")
                f = ferry_rows.get((bs, il, ol))
                if f is not None:
                    c = compare(r, f, step)
                    r["vs_ferry"] = c
                    print(f"ferry bs={bs} in={il} out={ol} | prefill "
                          f"{f['prefill_latency_s']:.4f} s | decode "
                          f"{f['median_decode_latency_s'] * 1e3:.3f} ms/step "
                          f"({f['median_decode_throughput_tok_s']:.1f} tok/s) | ferry/HF: "
                          f"prefill x{c['prefill_speedup']:.2f}, decode "
                          f"x{c['decode_speedup']:.2f} | roofline: ferry "
                          f"{c['ferry_roofline_fraction']:.1%} vs HF "
                          f"{c['hf_roofline_fraction']:.1%}")
                elif ferry_rows:
                    print(f"ferry bs={bs} in={il} out={ol} | no matching line in "
                          f"{ns.ferry_jsonl}")
                if ns.result_jsonl:
                    with open(ns.result_jsonl, "a") as fh:
                        fh.write(json.dumps(_json_safe(r), allow_nan=False) + "\n")
                results.append(r)
    return results


if __name__ == "__main__":
    main()
