#!/usr/bin/env bash
# Closed-loop, non-streamed measurement through spine only (the spine pieces of scripts/bench.sh):
# mock engine on CPU $HARNESS_CPU, gateway + agent on CPU $SUT_CPU, 64 connections for [secs].
# Used to compare two builds side by side (e.g. before/after a change), see docs/benchmarks.md.
# usage: [BENCH_BIN=<dir with release binaries, default target/release>] scripts/bench_closed_loop.sh [secs]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${SPINE_CACHE:-$HOME/.cache/spine}"
SECS="${1:-10}"
TARGETS=spine
HARNESS_CPU="${HARNESS_CPU:-0}"
SUT_CPU="${SUT_CPU:-1}"
log() { echo "[bench] $*" >&2; }
source "$CACHE/env.sh"
PY="${SPINE_PYTHON:-python3}"
BIN="${BENCH_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release}"
WORK="$(mktemp -d /tmp/spine-closed.XXXXXX)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [[ -n "${BENCH_KEEP:-}" ]] || rm -rf "$WORK"
}
trap cleanup EXIT
json_get() { "$PY" -c 'import json,sys; v=json.load(sys.stdin)
for k in sys.argv[1:]: v=v[int(k)] if isinstance(v,list) else v[k]
print(v)' "$@"; }
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { for _ in $(seq 1 $(( $2 * 10 ))); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done; log "$1 did not come up"; return 1; }
# --- mock engine ---------------------------------------------------------------------------
MOCK_PORT="$(free_port)"
taskset -c "$HARNESS_CPU" "$BIN/spine-mock-engine" --listen "127.0.0.1:$MOCK_PORT" --model smollm2 \
  --completion-tokens 1024 >"$WORK/mock.out" 2>"$WORK/mock.log" &
MOCK_PID=$!
PIDS+=("$MOCK_PID")
MOCK="http://127.0.0.1:$MOCK_PORT"
wait_for "$MOCK/health" 20
mock_config() { curl -fsS -X POST -H 'content-type: application/json' --data "$1" "$MOCK/mock/config" >/dev/null; }

# --- spine: gateway + agent ----------------------------------------------------------------
SPINE_PIDS=()
if [[ " $TARGETS " == *" spine "* ]]; then
  ADMIN_TOKEN="bench-admin-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  cat > "$WORK/gateway.toml" <<TOML
public_listen = "127.0.0.1:0"
tunnel_listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
admin_token = "$ADMIN_TOKEN"
data_dir = "$WORK/data"

[[models]]
id = "smollm2"
gguf = "$SPINE_MODEL_GGUF"
input_price_micros_per_mtok = 150000
output_price_micros_per_mtok = 600000
TOML
  mkfifo "$WORK/ready"
  RUST_LOG=warn taskset -c "$SUT_CPU" "$BIN/reference-gateway" --config "$WORK/gateway.toml" >"$WORK/ready" 2>"$WORK/gateway.log" &
  GATEWAY_PID=$!
  PIDS+=("$GATEWAY_PID")
  read -r READY < "$WORK/ready"
  PUBLIC="http://$(echo "$READY" | json_get public_addr)"
  ADMIN="http://$(echo "$READY" | json_get admin_addr)"
  TUNNEL="wss://$(echo "$READY" | json_get tunnel_addr)/v1/tunnel"
  CA_FILE="$(echo "$READY" | json_get tunnel_ca_file)"
  admin() { curl -fsS -X "$1" -H "Authorization: Bearer $ADMIN_TOKEN" -H 'content-type: application/json' ${3:+--data "$3"} "$ADMIN$2"; }
  OPERATOR="$(admin POST /admin/v1/operators '{}' | json_get id)"
  ACCOUNT="$(admin POST /admin/v1/accounts '{}' | json_get id)"
  SPINE_KEY="$(admin POST "/admin/v1/accounts/$ACCOUNT/keys" '{}' | json_get key)"
  admin POST "/admin/v1/accounts/$ACCOUNT/credits" '{"amount_micros": 1000000000000, "idempotency_key": "bench-topup"}' >/dev/null
  PUBKEY="$("$BIN/reference-agent" keygen --out "$WORK/node.key" 2>/dev/null)"
  NODE="$(admin POST /admin/v1/nodes "{\"operator_id\": \"$OPERATOR\", \"public_key\": \"$PUBKEY\"}" | json_get node_id)"
  RUST_LOG=warn taskset -c "$SUT_CPU" "$BIN/reference-agent" run --gateway "$TUNNEL" --identity "$WORK/node.key" \
    --ca-file "$CA_FILE" --engine llama.cpp --engine-url "$MOCK" --max-concurrency 1024 \
    >"$WORK/agent.log" 2>&1 &
  AGENT_PID=$!
  PIDS+=("$AGENT_PID")
  for _ in $(seq 1 200); do admin GET /admin/v1/nodes | grep -q "\"$NODE\"" && break; sleep 0.1; done
  admin GET /admin/v1/nodes | grep -q "\"$NODE\"" || { log "node never became routable"; tail -20 "$WORK/agent.log" >&2; exit 1; }
  SPINE_PIDS=("$GATEWAY_PID" "$AGENT_PID")
  # the mock claims the prompt tokens spine bills for the benchmark's prompt, so that no request
  # is flagged as a usage discrepancy (a flagged request costs a log line and a registry update)
  CALIBRATE="$(curl -fsS -H "Authorization: Bearer $SPINE_KEY" -H 'content-type: application/json' \
    --data '{"model":"smollm2","messages":[{"role":"user","content":"Say the word the, many times."}],"max_tokens":16}' \
    "$PUBLIC/v1/chat/completions")"
  PROMPT_TOKENS="$(echo "$CALIBRATE" | json_get usage prompt_tokens)"
  COMPLETION_TOKENS="$(echo "$CALIBRATE" | json_get usage completion_tokens)"
  log "spine up: gateway pid $GATEWAY_PID, agent pid $AGENT_PID (CPU $SUT_CPU); billed prompt $PROMPT_TOKENS, completion $COMPLETION_TOKENS tokens"
  mock_config "{\"prompt_tokens\": $PROMPT_TOKENS}"
fi


# warm-up 2 s, then the measurement
taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name spine --scenario warmup --url "$PUBLIC/v1/chat/completions" \
  --api-key "$SPINE_KEY" --concurrency 64 --duration-secs 2 --max-tokens 16 >/dev/null
[[ -n "${SKIP_CLOSED:-}" ]] || taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name spine --scenario max_throughput --url "$PUBLIC/v1/chat/completions" \
  --api-key "$SPINE_KEY" --cpu-pid "$GATEWAY_PID" --cpu-pid "$AGENT_PID" --concurrency 64 --duration-secs "$SECS" --max-tokens 16
if [[ -n "${BENCH_OPEN_RATE:-}" ]]; then
taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name spine --scenario non_streamed --url "$PUBLIC/v1/chat/completions" \
  --api-key "$SPINE_KEY" --cpu-pid "$GATEWAY_PID" --cpu-pid "$AGENT_PID" --rate "$BENCH_OPEN_RATE" --duration-secs 5 --warmup-secs 1 --max-tokens 16 --max-in-flight 512
fi
