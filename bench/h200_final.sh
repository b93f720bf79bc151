#!/usr/bin/env bash
# One bounded GPU call: `bash bench/h200_final.sh PART...` runs the named parts, each with its
# own time limit, so the call ends inside the device budget (the stages of bench/h200_run.sh
# run the same commands without the bounds). Parts: wq-tests awq-latency awq-sweep lora
# lora-serving spec-gputest eagle3 bf16-latency ngram-real stash-gguf1.
set -u
OUT=${OUT:-./out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
L8B=engine/configs/llama-3-8b.json
part() { local name=$1 t=$2; shift 2; echo "=== $name ($(date +%T))"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  grep -v "it/s\]" "$OUT/$name.log" | grep -Ev "^\s*$|Warning|warn" | tail -n ${TAIL:-8}; echo "=== $name rc=$rc"; }
for p in "$@"; do case $p in
  wq-tests) part wq-tests 120 python3 -m pytest -q -x tests/kernels/test_wq_kernels.py \
      tests/kernels/test_wq_gemv.py -p no:cacheprovider;;
  awq-latency) part awq-latency 120 python3 -m bench.bench_latency --model-path $L8B \
      --load-format dummy --quantization awq --batch-size 1 64 --input-len 512 --output-len 64 \
      --result-jsonl "$OUT/awq-latency.jsonl";;
  bf16-latency) part bf16-latency 100 python3 -m bench.bench_latency --model-path $L8B \
      --load-format dummy --batch-size 1 64 --input-len 512 --output-len 64 \
      --result-jsonl "$OUT/bf16-latency.jsonl";;
  awq-sweep) TAIL=60 part awq-sweep ${SWEEP_T:-330} python3 -m bench.kernels.sweep_gemm_wq \
      --batch-sizes ${SWEEP_M:-1,64,512} --configs ${SWEEP_CONFIGS:-1,64,512} \
      --result-json "$OUT/wq-sweep.json";;
  lora) part lora ${LBT:-120} python3 -m bench.bench_lora --model-path $L8B --load-format dummy \
      --num-adapters 4 --lora-rank 16 --batch-size 1 64 --input-len 512 --reps 8 \
      --result-jsonl "$OUT/lora.jsonl";;
  lora-serving) part lora-serving ${LST:-240} bash bench/h200_run.sh lora-serving;;
  lora-gputest) part lora-gputest ${LT:-100} python3 -m pytest -q -x tests/engine/test_lora.py -k gpu \
      -p no:cacheprovider;;
  spec-gputest) part spec-gputest ${ST:-150} python3 -m pytest -q -x \
      tests/engine/test_speculative_models_gpu.py -p no:cacheprovider;;
  eagle3) part eagle3 ${ET:-120} python3 -m bench.bench_speculative --model-path \
      engine/configs/llama-3-8b-smolvocab.json --load-format dummy --device cuda \
      --tokenizer-path .tok --algorithm EAGLE3 \
      --draft-model-path engine/configs/eagle3-llama-3.1-8b-smolvocab.json --num-steps 3 \
      --batch-sizes 1 --workloads copy --max-tokens 96 --result-jsonl "$OUT/spec-eagle3.jsonl";;
  ngram-real) # NGRAM on real weights: the embedded SmolLM2 GGUF (98 MB) travels in two calls
      # (.gguf1/part1 stored as /tmp/g1 by `stash-gguf1` in the first, .gguf2/part2 here)
      cat /tmp/g1 ../.gguf2/part2 > /tmp/smol.gguf 2>/dev/null || cat /tmp/g1 .gguf2/part2 > /tmp/smol.gguf
      part ngram-real ${NT:-200} python3 -m bench.bench_speculative --model-path /tmp/smol.gguf \
        --gguf-dequantize --dtype bfloat16 --device cuda --algorithm NGRAM --batch-sizes 1 16 \
        --workloads copy other --max-tokens 128 --result-jsonl "$OUT/ngram-real.jsonl";;
  stash-gguf1) cp .gguf1/part1 /tmp/g1 2>/dev/null || cp ../.gguf1/part1 /tmp/g1; ls -la /tmp/g1;;
  *) echo "unknown part $p";;
esac; done
# at most 8 files come back: every log and result in one archive
(cd "$OUT" && tar czf /tmp/results.tgz . && find . -type f -delete && mv /tmp/results.tgz .)
