#!/usr/bin/env bash
# The main job, end to end on one machine:
#   set up what is missing (engine, model, Python SDK) → build spine → start llama-server, the
#   gateway (SQLite ledger, single instance) and an agent → create an operator, an account, a key
#   and credits → send a real streamed chat completion with the official OpenAI SDK → print the
#   reply, the usage and the ledger record. Everything it started is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
CACHE="${SPINE_CACHE:-$HOME/.cache/spine}"

scripts/setup.sh
# shellcheck disable=SC1091
source "$CACHE/env.sh"

echo "[demo] building spine (cargo build --workspace --bins)" >&2
cargo build --quiet --workspace --bins
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/spine-demo.XXXXXX")"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { "$SPINE_PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
json_get() { "$SPINE_PYTHON" -c 'import json,sys; v=json.load(sys.stdin)
for k in sys.argv[1:]: v=v[k]
print(v)' "$@"; }
wait_for() { # url seconds
  for _ in $(seq 1 $(( $2 * 10 ))); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "[demo] $1 did not come up" >&2; return 1
}

ENGINE_PORT="$(free_port)"
echo "[demo] starting llama-server (SmolLM2-135M-Instruct, alias smollm2) on 127.0.0.1:$ENGINE_PORT" >&2
"$SPINE_LLAMA_SERVER" -m "$SPINE_MODEL_GGUF" --alias smollm2 --host 127.0.0.1 --port "$ENGINE_PORT" \
  -c 4096 -np 2 -t 2 >"$WORK/llama.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$ENGINE_PORT/health" 120

ADMIN_TOKEN="demo-admin-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
cat > "$WORK/gateway.toml" <<TOML
public_listen = "127.0.0.1:0"
tunnel_listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
admin_token = "$ADMIN_TOKEN"
data_dir = "$WORK/data"

[[models]]
id = "smollm2"
gguf = "$SPINE_MODEL_GGUF"
input_price_micros_per_mtok = 150000   # 0.15 per million prompt tokens
output_price_micros_per_mtok = 600000  # 0.60 per million completion tokens
TOML
echo "[demo] starting reference-gateway" >&2
mkfifo "$WORK/ready"
"$BIN/reference-gateway" --config "$WORK/gateway.toml" >"$WORK/ready" 2>"$WORK/gateway.log" &
PIDS+=($!)
read -r READY < "$WORK/ready"
PUBLIC="http://$(echo "$READY" | json_get public_addr)"
ADMIN="http://$(echo "$READY" | json_get admin_addr)"
TUNNEL="wss://$(echo "$READY" | json_get tunnel_addr)/v1/tunnel"
CA_FILE="$(echo "$READY" | json_get tunnel_ca_file)"
echo "[demo] gateway: public $PUBLIC, admin $ADMIN, tunnel $TUNNEL (TLS, CA $CA_FILE)" >&2

admin() { # method path [json]
  curl -fsS -X "$1" -H "Authorization: Bearer $ADMIN_TOKEN" -H 'content-type: application/json' \
    ${3:+--data "$3"} "$ADMIN$2"
}
OPERATOR="$(admin POST /admin/v1/operators '{}' | json_get id)"
ACCOUNT="$(admin POST /admin/v1/accounts '{}' | json_get id)"
API_KEY="$(admin POST "/admin/v1/accounts/$ACCOUNT/keys" '{}' | json_get key)"
admin POST "/admin/v1/accounts/$ACCOUNT/credits" '{"amount_micros": 1000000, "idempotency_key": "demo-topup"}' >/dev/null
PUBKEY="$("$BIN/reference-agent" keygen --out "$WORK/node.key" 2>/dev/null)"
NODE="$(admin POST /admin/v1/nodes "{\"operator_id\": \"$OPERATOR\", \"public_key\": \"$PUBKEY\"}" | json_get node_id)"
echo "[demo] operator $OPERATOR, account $ACCOUNT (1,000,000 micros of credit), node $NODE ($PUBKEY)" >&2

echo "[demo] starting reference-agent (dials the gateway over TLS, serves llama-server)" >&2
"$BIN/reference-agent" run --gateway "$TUNNEL" --identity "$WORK/node.key" --ca-file "$CA_FILE" \
  --engine llama.cpp --engine-url "http://127.0.0.1:$ENGINE_PORT" --max-concurrency 2 \
  >"$WORK/agent.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 200); do
  admin GET /admin/v1/nodes | grep -q "\"$NODE\"" && break
  sleep 0.1
done
admin GET /admin/v1/nodes | grep -q "\"$NODE\"" || { echo "[demo] node never became routable" >&2; tail -20 "$WORK/agent.log" >&2; exit 1; }
echo "[demo] node $NODE is routable; sending a streamed chat completion with the OpenAI SDK" >&2
echo

OUT="$("$SPINE_PYTHON" "$ROOT/scripts/openai_chat.py" "$PUBLIC/v1" "$API_KEY" "Name three colors.")"
echo "$OUT"
REQUEST_ID="$(echo "$OUT" | sed -n 's/^\[streamed request id\] //p')"
sleep 0.2
echo
echo "[ledger record of the streamed request $REQUEST_ID]"
admin GET "/admin/v1/requests/$REQUEST_ID" | "$SPINE_PYTHON" -m json.tool
echo "[account $ACCOUNT]"
admin GET "/admin/v1/accounts/$ACCOUNT" | "$SPINE_PYTHON" -m json.tool
echo "[operator $OPERATOR]"
admin GET "/admin/v1/operators/$OPERATOR" | "$SPINE_PYTHON" -m json.tool
