#!/usr/bin/env bash
# Side-by-side load benchmark (issue 7), one command, one run, the same mock engine for every path:
#   direct   load generator → mock engine
#   spine    load generator → reference-gateway (metering on, SQLite ledger) → TLS tunnel →
#            reference-agent → mock engine                          (release builds)
#   litellm  load generator → LiteLLM proxy (pinned version, no database) → mock engine
# and prints markdown tables: added latency at several fixed rates (open loop, no coordinated
# omission), closed-loop max throughput, streaming events relayed per second with the system
# under test's CPU time, and the per-event latency each path adds. Ratios come from this run only.
#
# CPU placement (the machine has 2 cores): the harness (load generator + mock engine) runs on
# CPU $HARNESS_CPU, the system under test (gateway + agent, or LiteLLM's workers) on CPU $SUT_CPU,
# both with `taskset`. LiteLLM gets one worker per core it is given (its documented default is one
# per logical CPU), so `--num_workers 1`.
#
# Knobs (environment): BENCH_RATES (default "50 200 1000 2000 5000"), BENCH_SECS (5), BENCH_TARGETS
# ("direct spine litellm"), LITELLM_VERSION (1.108.7), HARNESS_CPU (0), SUT_CPU (1),
# BENCH_OUT (results file, default a temp file; the tables go to stdout), BENCH_BIN (use the
# binaries in this directory instead of building), BENCH_KEEP (keep the work directory and logs).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
spine_init bench
cd "$ROOT"
RATES="${BENCH_RATES:-50 200 1000 2000 5000}"
SECS="${BENCH_SECS:-5}"
TARGETS="${BENCH_TARGETS:-direct spine litellm}"
LITELLM_VERSION="${LITELLM_VERSION:-1.108.7}"
HARNESS_CPU="${HARNESS_CPU:-0}"
SUT_CPU="${SUT_CPU:-1}"
SPINE_KEEP="${BENCH_KEEP:-}"
BIN="${BENCH_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release}"
if [[ -z "${BENCH_BIN:-}" ]]; then
  log "building release binaries (reference-gateway, reference-agent, spine-bench)"
  cargo build --quiet --release -p reference-gateway -p reference-agent -p spine-bench
fi

LITELLM_VENV="$CACHE/litellm-venv"
if [[ " $TARGETS " == *" litellm "* ]]; then
  if ! "$LITELLM_VENV/bin/python" -c "import litellm, importlib.metadata as m; assert m.version('litellm') == '$LITELLM_VERSION'" 2>/dev/null; then
    log "installing litellm[proxy]==$LITELLM_VERSION into $LITELLM_VENV"
    python3 -m venv "$LITELLM_VENV"
    "$LITELLM_VENV/bin/pip" install --quiet "litellm[proxy]==$LITELLM_VERSION"
  fi
fi

spine_workdir bench
OUT="${BENCH_OUT:-$WORK/results.jsonl}"
: > "$OUT"
on_harness() { taskset -c "$HARNESS_CPU" "$@"; }

# --- mock engine ---------------------------------------------------------------------------
bench_start_mock "$BIN"

# --- spine: gateway + agent ----------------------------------------------------------------
SPINE_PIDS=()
if [[ " $TARGETS " == *" spine "* ]]; then
  bench_start_spine "$BIN"
fi

# --- LiteLLM -------------------------------------------------------------------------------
LITELLM_PIDS=()
if [[ " $TARGETS " == *" litellm "* ]]; then
  LITELLM_PORT="$(free_port)"
  LITELLM_KEY="sk-bench-$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  cat > "$WORK/litellm.yaml" <<YAML
model_list:
  - model_name: smollm2
    litellm_params:
      model: openai/smollm2
      api_base: $MOCK/v1
      api_key: none
general_settings:
  master_key: $LITELLM_KEY
litellm_settings:
  request_timeout: 600
  set_verbose: false
  json_logs: true
YAML
  LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_LOG=ERROR LITELLM_TELEMETRY=False \
    taskset -c "$SUT_CPU" "$LITELLM_VENV/bin/litellm" --config "$WORK/litellm.yaml" --host 127.0.0.1 \
    --port "$LITELLM_PORT" --num_workers 1 >"$WORK/litellm.log" 2>&1 &
  LITELLM_PID=$!
  PIDS+=("$LITELLM_PID")
  wait_for "http://127.0.0.1:$LITELLM_PORT/health/liveliness" 120
  # the proxy process and its workers
  LITELLM_PIDS=("$LITELLM_PID" $(pgrep -P "$LITELLM_PID" || true))
  log "litellm $LITELLM_VERSION up: pids ${LITELLM_PIDS[*]} (CPU $SUT_CPU)"
fi

url_of() {
  case "$1" in
    direct) echo "$MOCK/v1/chat/completions" ;;
    spine) echo "$PUBLIC/v1/chat/completions" ;;
    litellm) echo "http://127.0.0.1:$LITELLM_PORT/v1/chat/completions" ;;
  esac
}
key_args() {
  case "$1" in
    spine) echo "--api-key $SPINE_KEY" ;;
    litellm) echo "--api-key $LITELLM_KEY" ;;
  esac
}
pid_args() {
  local pids=()
  case "$1" in
    direct) pids=("$MOCK_PID") ;;
    spine) pids=("${SPINE_PIDS[@]}") ;;
    litellm) pids=("${LITELLM_PIDS[@]}") ;;
  esac
  for p in "${pids[@]}"; do printf -- '--cpu-pid %s ' "$p"; done
}
load() { # target scenario args...
  local t="$1" s="$2"; shift 2
  # shellcheck disable=SC2046
  on_harness "$BIN/spine-load" run --name "$t" --scenario "$s" --url "$(url_of "$t")" \
    $(key_args "$t") $(pid_args "$t") "$@" | tee -a "$OUT" | grep -q '"sustained":true' && echo ok || echo saturated
}

# A target that fell behind keeps working off requests the client gave up on (LiteLLM does);
# before the next measurement wait (up to 60 s) until one small request takes under 1 s again.
drain() { # target
  local key; key="$(key_args "$1" | sed 's/--api-key //')"
  for _ in $(seq 1 60); do
    curl -fsS -o /dev/null -m 1 ${key:+-H "Authorization: Bearer $key"} -H 'content-type: application/json' \
      --data '{"model":"smollm2","messages":[{"role":"user","content":"hi"}],"max_tokens":1}' "$(url_of "$1")" \
      2>/dev/null && return 0
    sleep 1
  done
  log "$1 still busy after 60 s"
}

# --- 1. non-streamed, open loop at each rate, targets interleaved per rate ------------------
log "non-streamed open loop: rates $RATES, ${SECS}s each (+1 s warm-up), 16 completion tokens"
declare -A SATURATED=()
for rate in $RATES; do
  for t in $TARGETS; do
    [[ -n "${SATURATED[$t]:-}" ]] && continue
    state="$(load "$t" non_streamed --rate "$rate" --duration-secs "$SECS" --warmup-secs 1 --max-tokens 16 --max-in-flight 512)"
    [[ "$state" == saturated ]] && SATURATED[$t]=1 && drain "$t"
  done
done

# --- 2. non-streamed, closed loop max throughput --------------------------------------------
# BENCH_PERF_DIR: record a perf profile (call graphs) of spine's processes during its closed-loop
# runs, for `perf report -i`.
perf_start() { # name
  PERF_PID=""
  if [[ -n "${BENCH_PERF_DIR:-}" && "$1" == spine ]]; then
    mkdir -p "$BENCH_PERF_DIR"
    perf record -F 999 -g --call-graph dwarf,16384 -o "$BENCH_PERF_DIR/$2.perf.data" \
      -p "$(IFS=,; echo "${SPINE_PIDS[*]}")" -- sleep "$SECS" >/dev/null 2>&1 &
    PERF_PID=$!
  fi
}
perf_stop() { [[ -n "${PERF_PID:-}" ]] && wait "$PERF_PID" 2>/dev/null || true; }

log "non-streamed closed loop: 64 connections, ${SECS}s each"
for t in $TARGETS; do
  perf_start "$t" max_throughput
  load "$t" max_throughput --concurrency 64 --duration-secs "$SECS" --max-tokens 16 >/dev/null
  perf_stop
  drain "$t"
done

# --- 3. streaming relay throughput ---------------------------------------------------------
log "streaming closed loop: 16 streams of 1000 events at a time, engine unpaced"
for t in $TARGETS; do
  perf_start "$t" stream_throughput
  load "$t" stream_throughput --stream --concurrency 16 --duration-secs "$SECS" --timeout-secs 60 --max-tokens 1000 >/dev/null
  perf_stop
  drain "$t"
done

# --- 4. streaming per-event latency ---------------------------------------------------------
log "streaming open loop: 20 streams/s of 64 events, engine paced at 1 ms per token"
mock_config '{"itl_micros": 1000, "ttft_micros": 1000}'
for t in $TARGETS; do
  load "$t" stream_latency --stream --rate 20 --duration-secs "$SECS" --warmup-secs 1 --max-tokens 64 >/dev/null
done
mock_config '{"itl_micros": 0, "ttft_micros": 0}'

echo "## Results ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs: harness on CPU $HARNESS_CPU, system under test on CPU $SUT_CPU)"
echo
"$BIN/spine-load" table "$OUT"
log "raw results: $OUT"
