#!/bin/bash
# Build kvserve and run the CUDA tests on a GPU machine that has torch, CUDA and cmake but no
# Debian packages or network (e.g. a lent GPU box), using build dependencies fetched beforehand.
#
#   tools/gpu_check.sh fetch     # on the Debian 12 dev machine: .gpudeps/ (Debian .debs + openai wheels)
#   tools/gpu_check.sh run       # on the GPU machine, from the repo root with .gpudeps/ copied along
#
# `run` unpacks the .debs into a prefix (never into /), builds the kvserve target against that
# machine's torch, makes the fixtures and runs tests/reference/test_cuda_vs_reference.py and
# tests/integration/test_cuda_serving.py. Logs go to $OUT (or /tmp/gpu-check).
# These are the steps that built and passed on an H100 on 2026-11-22 (docs/gpu.md), run then as an
# ad-hoc script; this file's `run` has not itself run on a GPU yet (no GPU was left to the session).
set -euo pipefail
DEPS=.gpudeps
DEBS="libboost1.74-dev libyaml-cpp-dev libyaml-cpp0.7 nlohmann-json3-dev libcli11-dev libspdlog-dev libspdlog1.10
  libfmt-dev libfmt9 libpcre2-dev libpcre2-8-0 libgtest-dev libgmock-dev libgloo-dev libbenchmark-dev
  libbenchmark1debian pkgconf pkgconf-bin libpkgconf3"
WHEELS="openai pydantic pydantic-core distro jiter sniffio annotated-types typing-inspection typing-extensions
  httpx2 httpcore2 truststore anyio h11"

case "${1:-}" in
fetch)
  mkdir -p "$DEPS/whl"
  (cd "$DEPS" && apt-get download $DEBS)
  for p in $WHEELS; do
    v=$(python3 -m pip show "$p" 2>/dev/null | awk '/^Version/{print $2}') || v=""
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 -d "$DEPS/whl" "$p${v:+==$v}"
  done
  grep -qx "/$DEPS/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$DEPS/" >> .git/info/exclude; }
  du -sh "$DEPS"
  ;;
run)
  out=${OUT:-/tmp/gpu-check}; mkdir -p "$out"
  export PYTHONUNBUFFERED=1
  prefix=/tmp/kvserve-deps; mkdir -p $prefix
  for f in "$DEPS"/*.deb; do dpkg -x "$f" $prefix; done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvserve-site "$DEPS"/whl/*.whl
  export PYTHONPATH=/tmp/kvserve-site${PYTHONPATH:+:$PYTHONPATH}
  lib=$prefix/usr/lib/x86_64-linux-gnu
  export PATH=$prefix/usr/bin:$PATH PKG_CONFIG_SYSROOT_DIR=$prefix
  export PKG_CONFIG_PATH=$lib/pkgconfig:$prefix/usr/share/pkgconfig CPATH=$prefix/usr/include
  export LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  nvidia-smi -L
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
  cmake -S . -B /tmp/kvserve-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix/usr;$lib/cmake;$prefix/usr/share/cmake" > "$out/cmake.log" 2>&1
  cmake --build /tmp/kvserve-build -j "$(nproc)" --target kvserve > "$out/build.log" 2>&1
  python3 tools/make_fixture_models.py --out /tmp/kvserve-fixtures > "$out/fixtures.log" 2>&1
  KVSERVE_BIN=/tmp/kvserve-build/kvserve KVSERVE_FIXTURES=/tmp/kvserve-fixtures \
    python3 -m pytest -q -p no:cacheprovider tests/reference/test_cuda_vs_reference.py \
    tests/integration/test_cuda_serving.py 2>&1 | tee "$out/pytest.log"
  ;;
*)
  echo "usage: tools/gpu_check.sh fetch|run" >&2; exit 2 ;;
esac
