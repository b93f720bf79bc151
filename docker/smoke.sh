#!/usr/bin/env bash
# Smoke test of a running ferry server through its OpenAI-compatible HTTP API.
#
#   bash docker/smoke.sh [BASE_URL]          # default http://127.0.0.1:30000
#
# Checks, in order, stopping at the first failure with a message and a non-zero exit:
#   1. GET  /health                  -> 200
#   2. GET  /v1/models               -> 200, a list; its first id is the model used below
#   3. POST /v1/chat/completions     -> 200, chat.completion with non-empty content and usage
#   4. POST /v1/chat/completions stream=true -> SSE chunks, a finish_reason, last `data: [DONE]`
#   5. POST /v1/completions          -> 200, text_completion with a text choice
#   6. POST /v1/chat/completions temperature=5 -> 400 with an OpenAI error object naming param
#   7. GET  /metrics (only if served) -> ferry:request_success_total present
#   8. with FERRY_API_KEY set: a call without the key -> 401
#
# Environment:
#   FERRY_API_KEY   sent as "Authorization: Bearer ..." when set
#   SMOKE_TIMEOUT   per-request limit in seconds (default 120); connect limit is 5 s
#   SMOKE_WAIT      seconds to wait for /health to turn 200 before failing (default 0)
# Needs bash and curl; JSON is read with jq when present, else python3.

set -euo pipefail

BASE_URL="${1:-${BASE_URL:-http://127.0.0.1:30000}}"
BASE_URL="${BASE_URL%/}"
TIMEOUT="${SMOKE_TIMEOUT:-120}"
WAIT="${SMOKE_WAIT:-0}"
API_KEY="${FERRY_API_KEY:-}"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
STEP="start"

T_STEP=$SECONDS
fail() { echo "SMOKE FAIL [$STEP]: $*" >&2; exit 1; }
pass() { echo "ok   [$STEP] $* ($((SECONDS - T_STEP)) s)"; T_STEP=$SECONDS; }

command -v curl >/dev/null 2>&1 || fail "curl is required"
if command -v jq >/dev/null 2>&1; then JSON=jq
elif command -v python3 >/dev/null 2>&1; then JSON=python3
else fail "need jq or python3 to read JSON"; fi

# http METHOD PATH [JSON_BODY] [auth|noauth] -> prints the status code; body in $TMP/body
http() {
    local method="$1" path="$2" data="${3:-}" auth="${4:-auth}"
    local args=(-sS -o "$TMP/body" -w '%{http_code}' --connect-timeout 5 --max-time "$TIMEOUT"
                -X "$method" "$BASE_URL$path")
    if [[ -n "$API_KEY" && "$auth" == auth ]]; then
        args+=(-H "Authorization: Bearer $API_KEY")
    fi
    if [[ -n "$data" ]]; then
        args+=(-H 'Content-Type: application/json' --data-binary "$data")
    fi
    : > "$TMP/body"
    curl "${args[@]}" 2> "$TMP/curl_err" || true   # status 000 = no HTTP answer; see curl_err
}

# jget FILE KEY... : value at the path (numbers index lists); strings raw, others as JSON;
# prints nothing and returns 1 when the path is missing or null.
jget() {
    local file="$1"; shift
    if [[ "$JSON" == jq ]]; then
        local path="" k
        for k in "$@"; do
            if [[ "$k" =~ ^[0-9]+$ ]]; then path+="[$k]"; else path+="[\"$k\"]"; fi
        done
        jq -e -r "(.$path) as \$v | if \$v == null then null
                  elif (\$v | type) == \"string\" then \$v else (\$v | tojson) end" \
            "$file" 2>/dev/null
    else
        python3 - "$file" "$@" <<'PY'
import json, sys
try:
    v = json.load(open(sys.argv[1], encoding="utf-8"))
    for k in sys.argv[2:]:
        v = v[int(k)] if isinstance(v, list) else v[k]
except Exception:
    sys.exit(1)
if v is None:
    sys.exit(1)
print(v if isinstance(v, str) else json.dumps(v))
PY
    fi
}

# json_escape STRING -> a JSON string literal
json_escape() {
    if [[ "$JSON" == jq ]]; then jq -Rn --arg s "$1" '$s'
    else python3 -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$1"; fi
}

# in_range VALUE LO HI : VALUE is an integer with LO <= VALUE <= HI
in_range() { [[ "$1" =~ ^[0-9]+$ ]] && (( $1 >= $2 && $1 <= $3 )); }

show_body() {
    if [[ -s "$TMP/curl_err" ]]; then tr '\n' ' ' < "$TMP/curl_err"; fi
    head -c 600 "$TMP/body" 2>/dev/null; echo
}

# ---- 1. health ---------------------------------------------------------------------------
STEP="health"
deadline=$(( $(date +%s) + WAIT ))
while :; do
    code="$(http GET /health)"
    [[ "$code" == 200 ]] && break
    if (( $(date +%s) >= deadline )); then
        fail "GET /health returned $code (expected 200): $(show_body)"
    fi
    sleep 2
done
pass "GET /health 200"

# ---- 2. models ---------------------------------------------------------------------------
STEP="models"
code="$(http GET /v1/models)"
[[ "$code" == 200 ]] || fail "GET /v1/models returned $code: $(show_body)"
[[ "$(jget "$TMP/body" object || true)" == list ]] || fail "/v1/models object is not 'list': $(show_body)"
MODEL="$(jget "$TMP/body" data 0 id)" || fail "/v1/models has no data[0].id: $(show_body)"
pass "GET /v1/models -> model id '$MODEL'"
MODEL_JSON="$(json_escape "$MODEL")"

# ---- 3. chat, non-stream -----------------------------------------------------------------
STEP="chat"
code="$(http POST /v1/chat/completions "{\"model\": $MODEL_JSON,
  \"messages\": [{\"role\": \"user\", \"content\": \"Say hello in one short sentence.\"}],
  \"max_tokens\": 8, \"temperature\": 0}")"
[[ "$code" == 200 ]] || fail "chat completion returned $code: $(show_body)"
[[ "$(jget "$TMP/body" object || true)" == chat.completion ]] \
    || fail "object is not 'chat.completion': $(show_body)"
content="$(jget "$TMP/body" choices 0 message content)" || fail "no choices[0].message.content: $(show_body)"
[[ -n "$content" ]] || fail "empty assistant content: $(show_body)"
finish="$(jget "$TMP/body" choices 0 finish_reason)" || fail "no finish_reason: $(show_body)"
[[ "$finish" == stop || "$finish" == length ]] || fail "finish_reason '$finish' not stop/length"
ctoks="$(jget "$TMP/body" usage completion_tokens)" || fail "no usage.completion_tokens: $(show_body)"
in_range "$ctoks" 1 8 || fail "usage.completion_tokens=$ctoks outside 1..8 (max_tokens 8)"
pass "chat completion: finish_reason=$finish completion_tokens=$ctoks"

# ---- 4. chat, stream ---------------------------------------------------------------------
STEP="chat-stream"
code="$(http POST /v1/chat/completions "{\"model\": $MODEL_JSON,
  \"messages\": [{\"role\": \"user\", \"content\": \"Count from one to five.\"}],
  \"max_tokens\": 8, \"temperature\": 0, \"stream\": true}")"
[[ "$code" == 200 ]] || fail "streamed chat returned $code: $(show_body)"
tr -d '\r' < "$TMP/body" > "$TMP/sse"
last="$(grep -v '^[[:space:]]*$' "$TMP/sse" | tail -n 1 || true)"
[[ "$last" == "data: [DONE]" ]] || fail "stream does not end with 'data: [DONE]' (last line: '$last')"
n_chunks=0; saw_finish=0
while IFS= read -r line; do
    payload="${line#data: }"
    [[ "$payload" == "[DONE]" ]] && continue
    printf '%s' "$payload" > "$TMP/chunk"
    obj="$(jget "$TMP/chunk" object)" || fail "SSE data is not a JSON chunk: ${payload:0:200}"
    [[ "$obj" == chat.completion.chunk ]] || fail "chunk object '$obj' is not chat.completion.chunk"
    if jget "$TMP/chunk" error >/dev/null; then fail "stream carried an error: ${payload:0:300}"; fi
    if jget "$TMP/chunk" choices 0 finish_reason >/dev/null; then saw_finish=1; fi
    n_chunks=$((n_chunks + 1))
done < <(grep '^data: ' "$TMP/sse")
(( n_chunks >= 1 )) || fail "no chat.completion.chunk before [DONE]"
(( saw_finish == 1 )) || fail "no chunk carried a finish_reason"
pass "streamed chat: $n_chunks chunks, finish_reason seen, ends with data: [DONE]"

# ---- 5. completions ----------------------------------------------------------------------
STEP="completions"
code="$(http POST /v1/completions "{\"model\": $MODEL_JSON, \"prompt\": \"The capital of France is\",
  \"max_tokens\": 4, \"temperature\": 0}")"
[[ "$code" == 200 ]] || fail "completion returned $code: $(show_body)"
[[ "$(jget "$TMP/body" object || true)" == text_completion ]] \
    || fail "object is not 'text_completion': $(show_body)"
jget "$TMP/body" choices 0 text >/dev/null || fail "no choices[0].text: $(show_body)"
ctoks="$(jget "$TMP/body" usage completion_tokens)" || fail "no usage.completion_tokens: $(show_body)"
in_range "$ctoks" 1 4 || fail "usage.completion_tokens=$ctoks outside 1..4 (max_tokens 4)"
pass "completion: completion_tokens=$ctoks"

# ---- 6. bad parameter -> OpenAI-shaped 400 -----------------------------------------------
STEP="bad-param"
code="$(http POST /v1/chat/completions "{\"model\": $MODEL_JSON,
  \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": 5}")"
[[ "$code" == 400 ]] || fail "temperature=5 returned $code, expected 400: $(show_body)"
jget "$TMP/body" error >/dev/null || fail "400 body has no 'error' object: $(show_body)"
msg="$(jget "$TMP/body" error message)" || fail "error has no message: $(show_body)"
param="$(jget "$TMP/body" error param)" || fail "error has no 'param': $(show_body)"
[[ "$param" == temperature ]] || fail "error.param is '$param', expected 'temperature'"
jget "$TMP/body" error type >/dev/null || fail "error has no 'type': $(show_body)"
pass "temperature=5 -> 400, param=$param (${msg:0:60})"

# ---- 7. metrics (optional route) ---------------------------------------------------------
STEP="metrics"
code="$(http GET /metrics)"
if [[ "$code" == 200 ]]; then
    grep -q '^ferry:request_success_total' "$TMP/body" \
        || fail "/metrics has no ferry:request_success_total series"
    pass "GET /metrics exposes ferry:* series"
else
    echo "skip [$STEP] GET /metrics returned $code"
fi

# ---- 8. auth -----------------------------------------------------------------------------
if [[ -n "$API_KEY" ]]; then
    STEP="auth"
    code="$(http GET /v1/models "" noauth)"
    [[ "$code" == 401 ]] || fail "request without the API key returned $code, expected 401"
    pass "missing API key -> 401"
fi

echo "SMOKE OK: $BASE_URL (model '$MODEL')"
