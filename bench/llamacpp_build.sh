#!/usr/bin/env bash
# Builds llama.cpp (CPU) for bench/bench_llamacpp.py from the PyPI source package llama-cpp-python,
# which vendors a current llama.cpp, its HF->GGUF converter and an OpenAI-compatible server.
#
#   bench/llamacpp_build.sh [DIR]     (default build-llamacpp/, git-ignored)
#
# Leaves in DIR: src/ (the unpacked sdist), build/bin/ (llama-bench, llama-batched-bench, libllama.so,
# libggml*.so), and
# smollm2-f32.gguf: the default model's float32 weights (models/smollm2-135m-instruct, the Q4_1
# GGUF dequantized) written back as GGUF by llama.cpp's own converter, so both engines can run the
# same float32 weights. The Python server runs from src/ against build/bin/ (LLAMA_CPP_LIB_PATH),
# so llama.cpp is compiled once, not a second time by pip.
set -euo pipefail
VERSION=0.3.36
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=$(mkdir -p "${1:-$ROOT/build-llamacpp}" && cd "${1:-$ROOT/build-llamacpp}" && pwd)
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
say() { echo "[llamacpp_build] $*" >&2; }

SRC=$DIR/src
if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
  say "downloading llama-cpp-python==$VERSION (source package, 77 MB)"
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-binary :all: --no-deps \
    "llama-cpp-python==$VERSION" -d "$DIR" ||
    { say "error: cannot download llama-cpp-python==$VERSION from PyPI"; exit 1; }
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$SRC" --strip-components=1
fi

# The server's own dependencies (the [server] extra of llama-cpp-python), without llama-cpp-python;
# sentencepiece because convert_hf_to_gguf.py imports it before it looks for a tokenizer.json.
"$PYTHON" -c 'import uvicorn, fastapi, sse_starlette, starlette_context, pydantic_settings, diskcache, sentencepiece' \
  2>/dev/null || {
  say "installing the server's and the converter's Python dependencies"
  "$PYTHON" -m pip install -q --disable-pip-version-check "uvicorn>=0.22" "fastapi>=0.100" "sse-starlette>=1.6.1" \
    "starlette-context>=0.3.6,<0.4" "pydantic-settings>=2.0.1" "diskcache>=5.6.1" sentencepiece
}

# -march=native turns on ggml's AMX matrix kernels wherever the CPU reports AMX, but a virtual machine
# may report AMX without letting a process use its tile registers (an Intel Xeon VM here: llama-bench
# died with SIGILL in tinygemm_kernel_amx on its first prompt), so they are left out. kvserve's own
# products never use AMX, and a batch-1 decode step is vec_dot either way.
NATIVE_FLAGS=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then NATIVE_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
STAMP="$DIR/build/kvserve-flags"
if [ ! -x "$DIR/build/bin/llama-bench" ] || [ ! -x "$DIR/build/bin/llama-batched-bench" ] || [ ! -f "$DIR/build/bin/libllama.so" ] ||
  [ "$(cat "$STAMP" 2>/dev/null)" != "native $NATIVE_FLAGS" ]; then
  say "building llama.cpp (CPU, shared libraries, llama-bench, llama-batched-bench) with $JOBS jobs${NATIVE_FLAGS:+ (no AMX)}"
  # No tests/examples/server/UI: the Python server is the one compared; no network at build time.
  nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
    -DCMAKE_C_FLAGS="$NATIVE_FLAGS" -DCMAKE_CXX_FLAGS="$NATIVE_FLAGS" >"$DIR/cmake.log" 2>&1
  nice -n 10 cmake --build "$DIR/build" -j "$JOBS" --target llama-bench llama-batched-bench llama >"$DIR/build.log" 2>&1
  echo "native $NATIVE_FLAGS" >"$STAMP"
fi

F32=$DIR/smollm2-f32.gguf
if [ ! -f "$F32" ]; then
  make -C "$ROOT" model >&2
  say "writing $F32 with llama.cpp's convert_hf_to_gguf.py"
  # The converter's own gguf-py first: it matches the vendored llama.cpp.
  PYTHONPATH="$SRC/vendor/llama.cpp/gguf-py" "$PYTHON" "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" \
    "$ROOT/models/smollm2-135m-instruct" --outtype f32 --outfile "$F32.tmp" >"$DIR/convert.log" 2>&1 ||
    { say "error: convert_hf_to_gguf.py failed, see $DIR/convert.log"; exit 1; }
  mv "$F32.tmp" "$F32"
fi
say "ready: $DIR/build/bin/llama-bench, $F32"
