#!/usr/bin/env bash
# The metering exactness study (docs/metering.md): N requests (default 200) straight to a real
# llama-server, the engine's usage against spine's independent count. Needs scripts/setup.sh.
# `scripts/exactness.sh 200 --responses`: the same cases as translated Responses API requests.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
spine_init exactness
cd "$ROOT"
cargo run -p spine-meter --example exactness -- "${1:-200}" "${@:2}"
