"""The ratios of stage ``moe-fuse`` of ``bench/h200_run.sh`` (issue 49 items 3 and 4): the
fused decode paths against the unfused ones, measured in the same call.

``python -m bench.moefuse_report OUT`` reads

* ``OUT/moefuse-MODEL-on.jsonl`` / ``-off.jsonl`` (``bench.bench_latency --result-jsonl``
  with ``FERRY_MOE_DECODE_MAX_M`` at its default / 0) for MODEL in :data:`ROOFLINE_MS`, and
* ``OUT/moefuse-lora-on.jsonl`` / ``-off.jsonl`` (``bench.bench_lora --result-jsonl`` with
  ``FERRY_LORA_FUSED_DECODE`` 1 / 0) and, if there, ``-allk.jsonl`` (the down projection
  fused too: ``FERRY_LORA_FUSED_MAX_K=16384``),

and prints per batch size the median decode step with each path, fused / unfused, and for the
MoE models at bs1 the fraction of the active-weight roofline (docs/benchmarks.md, "Mixture
of experts": 1.47 ms and 5.97 ms at 4.27 TB/s); for LoRA the adapters' step over the base step
with each path. A missing file is reported as missing (a run that timed out).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: bs1 active-weight roofline in ms (docs/benchmarks.md) and the issue's bs1 target fraction
ROOFLINE_MS = {"qwen3-30b-a3b": (1.47, 0.5), "mixtral-8x7b": (5.97, 0.8)}


def _rows(path: Path) -> list[dict] | None:
    if not path.exists():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def moe_lines(out: Path, model: str) -> list[str]:
    on, off = _rows(out / f"moefuse-{model}-on.jsonl"), _rows(out / f"moefuse-{model}-off.jsonl")
    if on is None or off is None:
        return [f"{model}: missing {'on' if on is None else 'off'} run"]
    off_by_bs = {r["batch_size"]: r["median_decode_latency_s"] for r in off}
    roof, target = ROOFLINE_MS[model]
    lines = []
    for r in on:
        bs, t_on = r["batch_size"], r["median_decode_latency_s"]
        t_off = off_by_bs.get(bs)
        line = f"{model} bs{bs}: fused {t_on * 1e3:.3f} ms"
        if t_off:
            line += f", unfused {t_off * 1e3:.3f} ms, fused/unfused {t_on / t_off:.3f}"
        if bs == 1:
            line += (f"; roofline {roof} ms: fused {roof / (t_on * 1e3):.2f}"
                     + (f", unfused {roof / (t_off * 1e3):.2f}" if t_off else "")
                     + f" (target {target})")
        lines.append(line)
    return lines


def lora_lines(out: Path) -> list[str]:
    on, off = _rows(out / "moefuse-lora-on.jsonl"), _rows(out / "moefuse-lora-off.jsonl")
    if on is None or off is None:
        return [f"lora: missing {'on' if on is None else 'off'} run"]
    allk = _rows(out / "moefuse-lora-allk.jsonl") or []
    lines = []
    for bs in sorted({r["batch_size"] for r in on}):
        for r in allk:
            if r["batch_size"] == bs and r["kind"] == "adapters":
                lines.append(f"lora bs{bs}: adapters {r['median_step_s'] * 1e3:.3f} ms with "
                             f"every projection fused (FERRY_LORA_FUSED_MAX_K=16384, "
                             f"{r['ratio_to_base']:.3f}x base)")
        pick = {}
        for name, rows in (("on", on), ("off", off)):
            pick[name] = {r["kind"]: r for r in rows if r["batch_size"] == bs}
        a_on, a_off = pick["on"].get("adapters"), pick["off"].get("adapters")
        if not a_on or not a_off:
            lines.append(f"lora bs{bs}: no adapters row")
            continue
        lines.append(f"lora bs{bs}: adapters {a_on['median_step_s'] * 1e3:.3f} ms fused "
                     f"({a_on['ratio_to_base']:.3f}x base), {a_off['median_step_s'] * 1e3:.3f}"
                     f" ms unfused ({a_off['ratio_to_base']:.3f}x base), fused/unfused "
                     f"{a_on['median_step_s'] / a_off['median_step_s']:.3f} (targets: "
                     f"<= 1.12x base at bs1, <= 1.25x at bs64)")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "out")
    for model in ROOFLINE_MS:
        print("\n".join(moe_lines(out, model)))
    print("\n".join(lora_lines(out)))


if __name__ == "__main__":
    main()
