#!/usr/bin/env bash
# Closed-loop, non-streamed measurement through spine only (the spine pieces of scripts/bench.sh):
# mock engine on CPU $HARNESS_CPU, gateway + agent on CPU $SUT_CPU, 64 connections for [secs].
# Used to compare two builds side by side (e.g. before/after a change), see docs/benchmarks.md.
# usage: [BENCH_BIN=<dir with release binaries, default target/release>] [BENCH_PG=1: the ledger on
#        PostgreSQL at 127.0.0.1:5432, a fresh database] [SKIP_CLOSED=1] [BENCH_OPEN_RATE=<req/s>
#        BENCH_OPEN_SECS=<secs, default 5> BENCH_RSS_EVERY=<secs> BENCH_SLOW_MICROS=<µs>: an open loop after the closed
#        one, with each process's RSS sampled while it runs] [BENCH_STREAM_RATE=<streams/s>
#        BENCH_STREAM_SECS=<secs, default 10>: bench.sh's streaming per-event latency scenario (64
#        events paced 1 ms apart), direct then spine] [BENCH_STREAM_THROUGHPUT=1: bench.sh's streaming
#        closed loop (16 streams of 1,000 unpaced events) through spine, [secs] long, with
#        the gateway's and agent's CPU] scripts/bench_closed_loop.sh [secs]
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
spine_init bench
SECS="${1:-10}"
HARNESS_CPU="${HARNESS_CPU:-0}"
SUT_CPU="${SUT_CPU:-1}"
BIN="${BENCH_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release}"
SPINE_KEEP="${BENCH_KEEP:-}"
spine_workdir closed
if [[ -n "${BENCH_PG:-}" ]]; then
  # the ledger on PostgreSQL (127.0.0.1:5432, trust auth): a fresh database, dropped at the end
  BENCH_DB="spine_bench_$$_$RANDOM"
  psql -h 127.0.0.1 -U postgres -d postgres -Atqc "CREATE DATABASE $BENCH_DB" >/dev/null
  trap 'spine_cleanup; psql -h 127.0.0.1 -U postgres -d postgres -Atqc "DROP DATABASE IF EXISTS $BENCH_DB WITH (FORCE)" >/dev/null' EXIT
  GATEWAY_EXTRA_TOML="database_url = \"postgres://postgres@127.0.0.1:5432/$BENCH_DB\""
fi
bench_start_mock "$BIN"
bench_start_spine "$BIN"

# warm-up 2 s, then the measurement
taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name spine --scenario warmup --url "$PUBLIC/v1/chat/completions" \
  --api-key "$SPINE_KEY" --concurrency 64 --duration-secs 2 --max-tokens 16 >/dev/null
[[ -n "${SKIP_CLOSED:-}" ]] || taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name spine --scenario max_throughput --url "$PUBLIC/v1/chat/completions" \
  --api-key "$SPINE_KEY" --cpu-pid "$GATEWAY_PID" --cpu-pid "$AGENT_PID" --concurrency 64 --duration-secs "$SECS" --max-tokens 16
rss() { for p in "$GATEWAY_PID" "$AGENT_PID"; do echo "pid $p $(grep -E '^VmRSS' "/proc/$p/status" | tr -s ' \t' ' ')"; done; }
if [[ -n "${BENCH_OPEN_RATE:-}" ]]; then
  taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name spine --scenario non_streamed --url "$PUBLIC/v1/chat/completions" \
    --api-key "$SPINE_KEY" --cpu-pid "$GATEWAY_PID" --cpu-pid "$AGENT_PID" --rate "$BENCH_OPEN_RATE" \
    --duration-secs "${BENCH_OPEN_SECS:-5}" --warmup-secs 1 --max-tokens 16 --max-in-flight 512 \
    ${BENCH_SLOW_MICROS:+--slow-micros "$BENCH_SLOW_MICROS"} &
  LOAD_PID=$!
  # BENCH_RSS_EVERY=<secs>: each process's RSS every that many seconds while the open loop runs
  while [[ -n "${BENCH_RSS_EVERY:-}" ]] && kill -0 "$LOAD_PID" 2>/dev/null; do
    sleep "$BENCH_RSS_EVERY"
    echo "rss at +$SECONDS s: $(rss | tr '\n' ' ')"
  done
  wait "$LOAD_PID"
fi
if [[ -n "${BENCH_STREAM_THROUGHPUT:-}" ]]; then
  taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name spine --scenario stream_throughput --url "$PUBLIC/v1/chat/completions" \
    --api-key "$SPINE_KEY" --cpu-pid "$GATEWAY_PID" --cpu-pid "$AGENT_PID" --stream --concurrency 16 \
    --duration-secs "$SECS" --timeout-secs 60 --max-tokens 1000
fi
if [[ -n "${BENCH_STREAM_RATE:-}" ]]; then
  mock_config '{"itl_micros": 1000, "ttft_micros": 1000}'
  for target in direct spine; do
    if [[ $target == direct ]]; then url="$MOCK/v1/chat/completions" key=() pids=(--cpu-pid "$MOCK_PID")
    else url="$PUBLIC/v1/chat/completions" key=(--api-key "$SPINE_KEY") pids=(--cpu-pid "$GATEWAY_PID" --cpu-pid "$AGENT_PID"); fi
    taskset -c "$HARNESS_CPU" "$BIN/spine-load" run --name "$target" --scenario stream_latency --url "$url" \
      "${key[@]}" "${pids[@]}" --stream --rate "$BENCH_STREAM_RATE" --duration-secs "${BENCH_STREAM_SECS:-10}" \
      --warmup-secs 1 --max-tokens 64 ${BENCH_SLOW_MICROS:+--slow-micros "$BENCH_SLOW_MICROS"}
  done
  mock_config '{"itl_micros": 0, "ttft_micros": 0}'
fi
# the ledger's group commits since the start (warm-up included: writes per commit), and the
# bytes the gateway wrote through write(2)-like calls (WAL frames and sockets, /proc/<pid>/io)
admin GET /metrics | grep -E '^spine_ledger_(commits|committed_writes)_total' || true
grep -E '^(wchar|syscw)' "/proc/$GATEWAY_PID/io" || true
rss
# the SQLite ledger's WAL file: its size is the most it held (SQLite writes it from the start
# again after a restart, and does not shrink it)
for f in "$WORK"/data/*-wal; do [[ -e "$f" ]] && echo "wal $(basename "$f") $(stat -c %s "$f") bytes"; done
