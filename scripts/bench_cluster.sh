#!/usr/bin/env bash
# N gateway instances in multi-instance mode on one fresh PostgreSQL database and one Redis key
# prefix, one agent per instance, in front of one mock engine; a closed loop of 64 connections
# split evenly across the instances, non-streamed (issue 17: the PostgreSQL ledger with one and
# two instances). Mock and load generators on CPU $HARNESS_CPU; every gateway and agent on CPU
# $SUT_CPU. Prints each load generator's JSON line, then one summary line: requests per second
# over all instances and gateway + agent CPU per request (all instances' processes).
# Needs PostgreSQL at 127.0.0.1:5432 (trust auth) and Redis at $SPINE_TEST_REDIS_URL (default
# redis://127.0.0.1:6379): scripts/services.sh starts both. The database and the key prefix are
# removed at the end. BENCH_ACCOUNTS=<k> (default 1) bills k accounts instead of one: each
# instance's connections are split over k load generators, one per account's key (a fleet's
# traffic spreads over many accounts; one account is the worst case, every hold and settlement
# locking the same row).
# usage: [BENCH_BIN=<dir with release binaries, default target/release>] [BENCH_ACCOUNTS=<k>]
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
    KEYS=()
    for _ in $(seq 1 "${BENCH_ACCOUNTS:-1}"); do
      create_tenant 1000000000000
      KEYS+=("$API_KEY")
    done
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
load() { # <instance> <key> <scenario> <concurrency> <secs> [--cpu-pid …]
  local i="$1" key="$2" scenario="$3" conc="$4" secs="$5"
  shift 5
  taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name "spine-$i" --scenario "$scenario" \
    --url "${PUBLICS[$i]}/v1/chat/completions" --api-key "$key" --concurrency "$conc" \
    --duration-secs "$secs" --max-tokens 16 "$@"
}
K="${#KEYS[@]}"
# (`wait` for the load generators by pid: a bare `wait` would wait for the gateways too)
LOADS=()
for i in $(seq 0 $((N - 1))); do
  for k in "${KEYS[@]}"; do
    load "$i" "$k" warmup $(((8 + K - 1) / K)) 2 >/dev/null &
    LOADS+=($!)
  done
done
wait "${LOADS[@]}"
CPU_ARGS=()
for p in "${SUT[@]}"; do CPU_ARGS+=(--cpu-pid "$p"); done
LOADS=()
for i in $(seq 0 $((N - 1))); do
  for j in $(seq 0 $((K - 1))); do
    if [[ "$i$j" == 00 ]]; then
      load "$i" "${KEYS[$j]}" "cluster_$N" $((64 / N / K)) "$SECS" "${CPU_ARGS[@]}" >"$BASE/load$i-$j.json" &
    else
      load "$i" "${KEYS[$j]}" "cluster_$N" $((64 / N / K)) "$SECS" >"$BASE/load$i-$j.json" &
    fi
    LOADS+=($!)
  done
done
wait "${LOADS[@]}"
cat "$BASE"/load*.json
"$PY" - "$N" "$K" "$BASE"/load0-0.json "$BASE"/load*.json <<'PY'
import json, sys
n, k, first = sys.argv[1], sys.argv[2], sys.argv[3]
reports = [json.load(open(p)) for p in sorted(set(sys.argv[4:]))]
ok = sum(r["ok"] for r in reports)
errors = sum(r["errors"] for r in reports)
secs = max(r["elapsed_secs"] for r in reports)
cpu = json.load(open(first))["watched_cpu_secs"]
print(f"{n} instance(s), {k} account(s): {ok / secs:.0f} req/s in all, {errors} errors, "
      f"{cpu / ok * 1e6:.0f} us of gateway + agent CPU per request ({cpu:.2f} CPU-s)")
PY
