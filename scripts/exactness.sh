#!/usr/bin/env bash
# The metering exactness study (docs/metering.md): N requests (default 200) straight to a real
# llama-server, the engine's usage against spine's independent count. Needs scripts/setup.sh.
# `scripts/exactness.sh 200 --responses`: the same cases as translated Responses API requests.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source "${SPINE_CACHE:-$HOME/.cache/spine}/env.sh"
cargo run -p spine-meter --example exactness -- "${1:-200}" "${@:2}"
