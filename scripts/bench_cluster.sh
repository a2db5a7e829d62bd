#!/usr/bin/env bash
# N gateway instances in multi-instance mode on one fresh PostgreSQL database and one Redis key
# prefix, one agent per instance, in front of one mock engine; a closed loop of 64 connections
# split evenly across the instances, non-streamed (issue 17: the PostgreSQL ledger with one and
# two instances). Mock and load generators on CPU $HARNESS_CPU; every gateway and agent on CPU
# $SUT_CPU. Prints each load generator's JSON line, then one summary line: requests per second
# over all instances and gateway + agent CPU per request (all instances' processes).
# Needs PostgreSQL at 127.0.0.1:5432 (trust auth) and Redis at $SPINE_TEST_REDIS_URL (default
# redis://127.0.0.1:6379): scripts/services.sh starts both. The database and the key prefix are
# removed at the end.
# usage: [BENCH_BIN=<dir with release binaries, default target/release>]
#        scripts/bench_cluster.sh [instances, default 2] [secs, default 10]
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
spine_init bench
N="${1:-2}"
SECS="${2:-10}"
HARNESS_CPU="${HARNESS_CPU:-0}"
SUT_CPU="${SUT_CPU:-1}"
BIN="${BENCH_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release}"
SPINE_KEEP="${BENCH_KEEP:-}"
REDIS_URL="${SPINE_TEST_REDIS_URL:-redis://127.0.0.1:6379}"
spine_workdir cluster
BASE="$WORK"
DB="spine_bench_$$_$RANDOM"
PREFIX="spine-bench-$$-$RANDOM:"
cleanup_cluster() {
  WORK="$BASE"
  spine_cleanup
  psql -h 127.0.0.1 -U postgres -d postgres -Atqc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null || true
  redis-cli -u "$REDIS_URL" --scan --pattern "$PREFIX*" | xargs -r redis-cli -u "$REDIS_URL" DEL >/dev/null || true
}
trap cleanup_cluster EXIT
psql -h 127.0.0.1 -U postgres -d postgres -Atqc "CREATE DATABASE $DB" >/dev/null
SECRET="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
bench_start_mock "$BIN"
PUBLICS=()
SUT=()
LAUNCH="env RUST_LOG=warn taskset -c $SUT_CPU"
for i in $(seq 0 $((N - 1))); do
  WORK="$BASE/gw$i"
  mkdir -p "$WORK"
  GATEWAY_EXTRA_TOML="database_url = \"postgres://postgres@127.0.0.1:5432/$DB\"
redis_url = \"$REDIS_URL\"
redis_key_prefix = \"$PREFIX\"
instance_id = \"bench-$i\"
internal_listen = \"127.0.0.1:0\"
cluster_secret = \"$SECRET\""
  start_gateway "$BIN" "[[models]]
id = \"smollm2\"
gguf = \"$SPINE_MODEL_GGUF\"
input_price_micros_per_mtok = 150000
output_price_micros_per_mtok = 600000"
  if [[ "$i" == 0 ]]; then
    create_tenant 1000000000000
  fi
  start_agent "$BIN" "$MOCK" 1024
  PUBLICS+=("$PUBLIC")
  SUT+=("$GATEWAY_PID" "$AGENT_PID")
done
LAUNCH=""
WORK="$BASE"
# the mock claims the prompt tokens spine bills (as bench_start_spine does)
PROMPT_TOKENS="$(curl -fsS -H "Authorization: Bearer $API_KEY" -H 'content-type: application/json' \
  --data '{"model":"smollm2","messages":[{"role":"user","content":"Say the word the, many times."}],"max_tokens":16}' \
  "${PUBLICS[0]}/v1/chat/completions" | json_get usage prompt_tokens)"
mock_config "{\"prompt_tokens\": $PROMPT_TOKENS}"
log "$N instances up on database $DB (gateway and agent pids ${SUT[*]}, CPU $SUT_CPU)"
load() { # <instance> <scenario> <concurrency> <secs> [--cpu-pid …]
  local i="$1" scenario="$2" conc="$3" secs="$4"
  shift 4
  taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name "spine-$i" --scenario "$scenario" \
    --url "${PUBLICS[$i]}/v1/chat/completions" --api-key "$API_KEY" --concurrency "$conc" \
    --duration-secs "$secs" --max-tokens 16 "$@"
}
# (`wait` for the load generators by pid: a bare `wait` would wait for the gateways too)
LOADS=()
for i in $(seq 0 $((N - 1))); do
  load "$i" warmup 8 2 >/dev/null &
  LOADS+=($!)
done
wait "${LOADS[@]}"
CPU_ARGS=()
for p in "${SUT[@]}"; do CPU_ARGS+=(--cpu-pid "$p"); done
LOADS=()
for i in $(seq 0 $((N - 1))); do
  if [[ "$i" == 0 ]]; then
    load "$i" "cluster_$N" $((64 / N)) "$SECS" "${CPU_ARGS[@]}" >"$BASE/load$i.json" &
  else
    load "$i" "cluster_$N" $((64 / N)) "$SECS" >"$BASE/load$i.json" &
  fi
  LOADS+=($!)
done
wait "${LOADS[@]}"
cat "$BASE"/load*.json
"$PY" - "$N" "$BASE"/load*.json <<'PY'
import json, sys
n, reports = sys.argv[1], [json.load(open(p)) for p in sys.argv[2:]]
ok = sum(r["ok"] for r in reports)
errors = sum(r["errors"] for r in reports)
secs = max(r["elapsed_secs"] for r in reports)
cpu = reports[0]["watched_cpu_secs"]
print(f"{n} instance(s): {ok / secs:.0f} req/s in all, {errors} errors, "
      f"{cpu / ok * 1e6:.0f} us of gateway + agent CPU per request ({cpu:.2f} CPU-s)")
PY
