#!/usr/bin/env bash
# session 11 call 1: verification of the unmeasured kernels (MXFP4 rewrite, FLA, 4-bit GEMV)
set -u
export OUT=${OUT:-./out}
S=$SECONDS
left() { echo $((570 - (SECONDS - S))); }
bash bench/h200_run.sh info gptoss-kernel
echo "left $(left)"
bash bench/h200_run.sh qwen3next-tests
echo "left $(left)"
[ $(left) -gt 150 ] && bash bench/h200_run.sh w4-check
echo "left $(left)"
if [ $(left) -gt 100 ]; then
  export PYTHONPATH=/tmp/site:$PWD
  timeout $(( $(left) - 10 )) python3 -m bench.bench_latency --model-path engine/configs/gpt-oss-20b.json \
    --load-format dummy --batch-size 1 64 --input-len 512 --output-len 64 2>&1 | grep -v "it/s" | tail -n 5
fi
echo "left $(left)"
