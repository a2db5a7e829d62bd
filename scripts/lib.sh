# shellcheck shell=bash
# The scripts' shared set-up: sourced by demo.sh, bench.sh, bench_closed_loop.sh and the other
# scripts, never run on its own.
#
#   spine_init <tag>        ROOT (repository root), CACHE (~/.cache/spine or $SPINE_CACHE), PY; loads
#                           $CACHE/env.sh (run scripts/setup.sh first; spine_init --setup <tag> does)
#   log <words>             one line on stderr, prefixed "[<tag>]"
#   json_get <key|index>…   reads JSON on stdin, prints the value at that path
#   free_port               a free TCP port on 127.0.0.1
#   wait_for <url> <secs>   polls the URL until it answers 2xx, at most <secs> seconds
#   spine_workdir <name>    WORK (a temp dir) and PIDS (started processes); both are cleaned up on
#                           exit (processes and their children killed; WORK kept with SPINE_KEEP=1)
#   start_gateway <bin> <models TOML>
#                           writes $WORK/gateway.toml (ephemeral ports, SQLite ledger in
#                           $WORK/data, a random admin token) and starts the gateway, prefixed by
#                           the words in $LAUNCH (e.g. "taskset -c 1"); sets ADMIN_TOKEN, PUBLIC,
#                           ADMIN, TUNNEL, CA_FILE, GATEWAY_PID
#   admin <method> <path> [json]   the admin API with the admin token
#   create_tenant <credit micros>  OPERATOR, ACCOUNT, API_KEY (the account credited)
#   start_agent <bin> <engine url> <max concurrency>
#                           a node key, its registration under OPERATOR, the agent (prefixed by
#                           $LAUNCH) dialing TUNNEL; returns once the node is routable; sets NODE,
#                           AGENT_PID

spine_init() {
  local setup=0
  if [[ "${1:-}" == "--setup" ]]; then setup=1; shift; fi
  LOG_TAG="$1"
  ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  CACHE="${SPINE_CACHE:-$HOME/.cache/spine}"
  # Builds are cached outside the clone: a clone with no target/ of its own gets a link to
  # $CACHE/target, so a fresh clone (CI's) recompiles only the workspace's own crates, not its
  # ~400 dependencies. CARGO_TARGET_DIR, or a target/ already there, is left as it is.
  if [[ -z "${CARGO_TARGET_DIR:-}" && ! -e "$ROOT/target" && ! -L "$ROOT/target" ]]; then
    mkdir -p "$CACHE/target"
    ln -s "$CACHE/target" "$ROOT/target"
  fi
  if [[ "$setup" == 1 ]]; then "$ROOT/scripts/setup.sh"; fi
  if [[ ! -f "$CACHE/env.sh" ]]; then
    echo "[$LOG_TAG] $CACHE/env.sh is missing: run scripts/setup.sh first" >&2
    exit 1
  fi
  # shellcheck disable=SC1091
  source "$CACHE/env.sh"
  PY="${SPINE_PYTHON:-python3}"
}

log() { echo "[$LOG_TAG] $*" >&2; }

json_get() {
  "$PY" -c 'import json,sys; v=json.load(sys.stdin)
for k in sys.argv[1:]: v=v[int(k)] if isinstance(v,list) else v[k]
print(v)' "$@"
}

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_for() {
  for _ in $(seq 1 $(( $2 * 10 ))); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done
  log "$1 did not come up"
  return 1
}

spine_workdir() {
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/spine-$1.XXXXXX")"
  PIDS=()
  trap spine_cleanup EXIT
}

spine_cleanup() {
  for pid in "${PIDS[@]}"; do
    for child in $(pgrep -P "$pid" 2>/dev/null); do kill "$child" 2>/dev/null || true; done
    kill "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  [[ -n "${SPINE_KEEP:-}" ]] || rm -rf "$WORK"
}

start_gateway() {
  local bin="$1" models="$2"
  ADMIN_TOKEN="$LOG_TAG-admin-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  cat > "$WORK/gateway.toml" <<TOML
public_listen = "127.0.0.1:0"
tunnel_listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
console_listen = "127.0.0.1:0"
admin_token = "$ADMIN_TOKEN"
data_dir = "$WORK/data"
${GATEWAY_EXTRA_TOML:-}

$models
TOML
  mkfifo "$WORK/ready"
  # shellcheck disable=SC2086 # $LAUNCH is words on purpose
  ${LAUNCH:-} "$bin/reference-gateway" --config "$WORK/gateway.toml" >"$WORK/ready" 2>"$WORK/gateway.log" &
  GATEWAY_PID=$!
  PIDS+=("$GATEWAY_PID")
  local ready
  read -r ready < "$WORK/ready"
  PUBLIC="http://$(echo "$ready" | json_get public_addr)"
  ADMIN="http://$(echo "$ready" | json_get admin_addr)"
  TUNNEL="wss://$(echo "$ready" | json_get tunnel_addr)/v1/tunnel"
  CA_FILE="$(echo "$ready" | json_get tunnel_ca_file)"
}

admin() {
  curl -fsS -X "$1" -H "Authorization: Bearer $ADMIN_TOKEN" -H 'content-type: application/json' \
    ${3:+--data "$3"} "$ADMIN$2"
}

create_tenant() {
  OPERATOR="$(admin POST /admin/v1/operators '{}' | json_get id)"
  ACCOUNT="$(admin POST /admin/v1/accounts '{}' | json_get id)"
  API_KEY="$(admin POST "/admin/v1/accounts/$ACCOUNT/keys" '{}' | json_get key)"
  admin POST "/admin/v1/accounts/$ACCOUNT/credits" \
    "{\"amount_micros\": $1, \"idempotency_key\": \"$LOG_TAG-topup-$ACCOUNT\"}" >/dev/null
}

start_agent() {
  local bin="$1" engine_url="$2" concurrency="$3" pubkey
  pubkey="$("$bin/reference-agent" keygen --out "$WORK/node.key" 2>/dev/null)"
  NODE="$(admin POST /admin/v1/nodes "{\"operator_id\": \"$OPERATOR\", \"public_key\": \"$pubkey\"}" | json_get node_id)"
  # shellcheck disable=SC2086 # $LAUNCH is words on purpose
  ${LAUNCH:-} "$bin/reference-agent" run --gateway "$TUNNEL" --identity "$WORK/node.key" \
    --ca-file "$CA_FILE" --engine llama.cpp --engine-url "$engine_url" --max-concurrency "$concurrency" \
    >"$WORK/agent.log" 2>&1 &
  AGENT_PID=$!
  PIDS+=("$AGENT_PID")
  for _ in $(seq 1 200); do
    admin GET /admin/v1/nodes | grep -q "\"$NODE\"" && return 0
    sleep 0.1
  done
  log "node $NODE never became routable"
  tail -20 "$WORK/agent.log" >&2
  return 1
}

# --- the benchmarks' pieces (bench.sh, bench_closed_loop.sh) --------------------------------
#   bench_start_mock <bin>  the mock engine on CPU $HARNESS_CPU; sets MOCK (its URL), MOCK_PID
#   mock_config <json>      reconfigures the mock
#   bench_start_spine <bin> gateway + agent on CPU $SUT_CPU in front of the mock, a tenant with
#                           10^12 micros; calibrates the mock to claim the prompt tokens spine bills
#                           for the benchmark's prompt (so that no request is flagged as a usage
#                           discrepancy: a flagged request costs a log line and a registry update);
#                           sets SPINE_KEY, SPINE_PIDS, PROMPT_TOKENS, COMPLETION_TOKENS

bench_start_mock() {
  local port
  port="$(free_port)"
  taskset -c "$HARNESS_CPU" "$1/spine-mock-engine" --listen "127.0.0.1:$port" --model smollm2 \
    --completion-tokens 1024 >"$WORK/mock.out" 2>"$WORK/mock.log" &
  MOCK_PID=$!
  PIDS+=("$MOCK_PID")
  MOCK="http://127.0.0.1:$port"
  wait_for "$MOCK/health" 20
}

mock_config() { curl -fsS -X POST -H 'content-type: application/json' --data "$1" "$MOCK/mock/config" >/dev/null; }

bench_start_spine() {
  local bin="$1" calibrate
  LAUNCH="env RUST_LOG=warn taskset -c $SUT_CPU"
  start_gateway "$bin" "[[models]]
id = \"smollm2\"
gguf = \"$SPINE_MODEL_GGUF\"
input_price_micros_per_mtok = 150000
output_price_micros_per_mtok = 600000"
  create_tenant 1000000000000
  SPINE_KEY="$API_KEY"
  start_agent "$bin" "$MOCK" 1024
  LAUNCH=""
  SPINE_PIDS=("$GATEWAY_PID" "$AGENT_PID")
  calibrate="$(curl -fsS -H "Authorization: Bearer $SPINE_KEY" -H 'content-type: application/json' \
    --data '{"model":"smollm2","messages":[{"role":"user","content":"Say the word the, many times."}],"max_tokens":16}' \
    "$PUBLIC/v1/chat/completions")"
  PROMPT_TOKENS="$(echo "$calibrate" | json_get usage prompt_tokens)"
  COMPLETION_TOKENS="$(echo "$calibrate" | json_get usage completion_tokens)"
  log "spine up: gateway pid $GATEWAY_PID, agent pid $AGENT_PID (CPU $SUT_CPU); billed prompt $PROMPT_TOKENS, completion $COMPLETION_TOKENS tokens"
  mock_config "{\"prompt_tokens\": $PROMPT_TOKENS}"
}
