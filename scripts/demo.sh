#!/usr/bin/env bash
# The main job, end to end on one machine:
#   set up what is missing (engine, model, Python SDK) → build spine → start llama-server, the
#   gateway (SQLite ledger, single instance) and an agent → create an operator, an account, a key
#   and credits → send a real streamed chat completion with the official OpenAI SDK → print the
#   reply, the usage and the ledger record. Everything it started is stopped on exit.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
spine_init --setup demo
cd "$ROOT"

log "building spine (cargo build --workspace --bins)"
cargo build --quiet --workspace --bins
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug"
spine_workdir demo

ENGINE_PORT="$(free_port)"
log "starting llama-server (SmolLM2-135M-Instruct, alias smollm2) on 127.0.0.1:$ENGINE_PORT"
"$SPINE_LLAMA_SERVER" -m "$SPINE_MODEL_GGUF" --alias smollm2 --host 127.0.0.1 --port "$ENGINE_PORT" \
  -c 4096 -np 2 -t 2 >"$WORK/llama.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$ENGINE_PORT/health" 120

log "starting reference-gateway"
start_gateway "$BIN" "[[models]]
id = \"smollm2\"
gguf = \"$SPINE_MODEL_GGUF\"
input_price_micros_per_mtok = 150000   # 0.15 per million prompt tokens
output_price_micros_per_mtok = 600000  # 0.60 per million completion tokens"
log "gateway: public $PUBLIC, admin $ADMIN, tunnel $TUNNEL (TLS, CA $CA_FILE)"

create_tenant 1000000
log "operator $OPERATOR, account $ACCOUNT (1,000,000 micros of credit)"
log "starting reference-agent (dials the gateway over TLS, serves llama-server)"
start_agent "$BIN" "http://127.0.0.1:$ENGINE_PORT" 2
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
