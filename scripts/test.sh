#!/usr/bin/env bash
# The test suite: set-up (idempotent), formatting, lints, every test including the end-to-end test
# against the real llama.cpp engine through the real tunnel, and a build check of the fuzz targets.
set -euo pipefail
start=$(date +%s)
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
spine_init --setup test
cd "$ROOT"

echo "[test] cargo fmt --check" >&2
cargo fmt --all -- --check
echo "[test] no file under any src/ over 800 lines (test files excepted: tests*.rs and src/**/tests/)" >&2
long="$(git ls-files -- '*/src/*.rs' ':!:*/tests*.rs' | xargs wc -l | awk '$2 != "total" && $1 > 800')"
if [[ -n "$long" ]]; then echo "[test] over 800 lines: $long" >&2; exit 1; fi
echo "[test] cargo clippy --all-targets -- -D warnings" >&2
cargo clippy --workspace --all-targets -- -D warnings
echo "[test] a MeterLayer or RouteLayer user compiles no sqlx, redis, tokenizers, minijinja or onig (no default features)" >&2
for crate in spine-meter spine-router; do
  heavy="$(cargo tree -q -e normal -p "$crate" --no-default-features | grep -oE '(sqlx|redis|tokenizers|minijinja|onig)[a-z_-]* v[0-9.]+' | sort -u || true)"
  if [[ -n "$heavy" ]]; then echo "[test] $crate without default features pulls in: $heavy" >&2; exit 1; fi
done
cargo check --quiet -p spine-meter -p spine-router --no-default-features
echo "[test] spine-meter's unit tests without default features (the meter with a counter of its own)" >&2
cargo test --quiet -p spine-meter --no-default-features --lib
echo "[test] cargo build --workspace --bins (the end-to-end test runs both binaries)" >&2
cargo build --workspace --bins
echo "[test] services the tests use: PostgreSQL and Redis on 127.0.0.1 (scripts/services.sh)" >&2
scripts/services.sh
echo "[test] cargo test --workspace --no-fail-fast (every failing test binary is reported)" >&2
cargo test --workspace --no-fail-fast
echo "[test] the README's quick start, exactly as written (scripts/readme-quickstart.sh)" >&2
scripts/readme-quickstart.sh
echo "[test] fuzz targets build (cargo check)" >&2
cargo check --quiet --manifest-path fuzz/Cargo.toml --bins --target-dir "${CARGO_TARGET_DIR:-target}"

echo "[test] all green in $(( $(date +%s) - start )) s" >&2
