#!/usr/bin/env bash
# One bounded GPU call for the seventh session's last figures (issues 26, 29, 30): each part
# has its own time limit so the call ends inside the device budget. Stages of the same
# commands live in bench/h200_run.sh (awq, spec-*, lora).
set -u
OUT=${OUT:-./out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
L8B=engine/configs/llama-3-8b.json
part() { local name=$1 t=$2; shift 2; echo "=== $name ($(date +%T))"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  grep -v "it/s\]" "$OUT/$name.log" | grep -Ev "^\s*$|Warning|warn" | tail -n ${TAIL:-8}; echo "=== $name rc=$rc"; }
part wq-tests 110 python3 -m pytest -q -x tests/kernels/test_wq_kernels.py -p no:cacheprovider
part awq-latency 110 python3 -m bench.bench_latency --model-path $L8B --load-format dummy \
  --quantization awq --batch-size 1 64 --input-len 512 --output-len 64 --result-jsonl "$OUT/awq-latency.jsonl"
part spec-gputest 80 python3 -m pytest -q -x tests/engine/test_speculative_models_gpu.py -p no:cacheprovider
part eagle3 90 python3 -m bench.bench_speculative --model-path engine/configs/llama-3-8b-smolvocab.json \
  --load-format dummy --device cuda --tokenizer-path .tok --algorithm EAGLE3 \
  --draft-model-path engine/configs/eagle3-llama-3.1-8b-smolvocab.json --num-steps 3 \
  --batch-sizes 1 --workloads copy --max-tokens 96 --result-jsonl "$OUT/spec-eagle3.jsonl"
part lora 110 python3 -m bench.bench_lora --model-path $L8B --load-format dummy --num-adapters 4 \
  --lora-rank 16 --batch-size 1 64 --input-len 512 --reps 8 --result-jsonl "$OUT/lora.jsonl"
