#!/bin/bash
# Build kvserve and run the CUDA tests on a GPU machine that has torch, CUDA and cmake but no
# Debian packages or network (e.g. a lent GPU box), using build dependencies fetched beforehand.
#
#   tools/gpu_check.sh fetch     # on the Debian 12 dev machine: .gpudeps/ (Debian .debs + openai wheels)
#   tools/gpu_check.sh run       # on the GPU machine, from the repo root with .gpudeps/ copied along
#   tools/gpu_check.sh bench [bench_gpu.py options]   # then, on the same machine: the GPU benchmark
#   tools/gpu_check.sh prefix [bench_prefix_cache.py options]   # prefix cache and host tier, 8B bf16
#   tools/gpu_check.sh kernels   # fused-kernel A/B of the decode step
#   tools/gpu_check.sh profile   # per-kernel tables of whole decode steps (Nsight Compute), see below
#   tools/gpu_check.sh attention [bench_paged_decode_cuda options]   # the decode attention variants' sweep
#   tools/gpu_check.sh fp8       # --quantization fp8, int8 and int4 against bf16 weights, 8B shape, 1K x 1 / 8 / 64 (not run yet)
#   tools/gpu_check.sh spec      # self-speculation against plain decoding, 8B shape, 32K x 16 (not run yet)
#   tools/gpu_check.sh ttft      # TTFT of 8 x 8K prompts at 1 / 2 / 4 / 8 prompts a prefill step (not run yet)
#   tools/gpu_check.sh kvquant   # int8 / int4 KV pools against bf16, 8B shape, 1K x 8, 32K x 8, pyramidkv 32K x 64 (not run yet)
# `all` fills its budget in the order below; on a 15-minute lease `run` and `bench --quick` take it all,
# so the steps after them are for a second command on the same warm machine (e.g.
# `tools/gpu_check.sh fp8; tools/gpu_check.sh spec; tools/gpu_check.sh ttft; tools/gpu_check.sh kvquant`, ~7 minutes).
#   tools/gpu_check.sh all       # all of the above in one call (~10 minutes on an H100; see below)
#
# `run` unpacks the .debs into a prefix (never into /), builds the kvserve target and any test
# target whose name contains "cuda" against that machine's torch, runs those gtests (ctest -R cuda),
# makes the fixtures and runs tests/reference/test_cuda_vs_reference.py and
# tests/integration/test_cuda_serving.py (GPU_PYTEST_K selects cases as pytest's -k, e.g. "not torch-ops
# and not fused-ops" for the default fused level only). Logs go to $OUT (or /tmp/gpu-check).
# `bench` runs bench/bench_gpu.py against /tmp/kvserve-build/kvserve (building it first if `run` has
# not), writing benchmarks-gpu.md (rewritten after each step), its JSON and the log into $OUT, and
# copies the .md to docs/. It needs transformers, safetensors and tokenizers, which the lent GPU
# image has (no wheels are carried for them). Its default run is sized for ~8 minutes on an H100,
# so give it its own command (a 10-minute limit), right after `run` while the machine still holds
# /tmp/kvserve-build (or alone: it then builds kvserve first, ~90 s; pass --budget-s 360).
# `prefix` measures issue 23's GPU row on the bench's random Llama-3.1-8B-shaped
# checkpoint (made as `bench` makes it, or reused from its cache): bench/bench_prefix_cache.py with
# model.device cuda and bfloat16, for full and pyramidkv. The document workload gives the miss and
# hits from the pool; the tier workload (a pool with room for about 1.6 8K requests, as on CPU, and
# a 4 GiB host tier) gives hits from host RAM. It prints the tier's copy-in time (tier hit - pool
# hit) in all and per layer. Sized for a few minutes on an H100; its log and JSON go to $OUT.
# `attention` (issue 34) builds bench/bench_paged_decode_cuda.cpp into the same $BUILD and runs it:
# the CUDA paged decode attention alone in the Llama-3.1-8B shape (bf16, 32/8 heads, D 128, block
# 16), contexts 1K/8K/32K x batch 1/8/64, every variant (split merge kernel | fold, 1/2/4/8 CTAs per
# SM, load depth 1/2), timed over 32 launches replayed from a CUDA graph (and eagerly) against a
# device copy's bandwidth. The tables go to stdout and $out/paged-decode-sweep.md, the JSON to
# $out/paged-decode-sweep.json. The sweep is sized for <= 55 s on an H100 (--budget-s: it skips the
# cells it has no time left for, the most expensive last); building the binary takes ~20 s after
# `run` (a whole build first when there was none, ~2 minutes). ATTENTION_BUDGET_S caps build + sweep.
# The winner is then picked at run time with KVSERVE_DECODE_MERGE=kernel|fold,
# KVSERVE_DECODE_CTAS_PER_SM=N and KVSERVE_DECODE_LOADS=1|2 (docs/gpu.md); none of it has run yet.
# `profile` (issue 34) makes the bench's 8B checkpoint if it is missing (~35 s; PROFILE_MODEL names
# another), then for each cell of PROFILE_CELLS (default "1024:1:full 32768:8:full
# 32768:64:pyramidkv:128", context:batch:policy[:budget], the cheapest first) and each fused level of
# PROFILE_LEVELS (default 2), runs two bench decode processes, bf16:
#   - with CUDA graphs and no ncu: the real step_s_median and host_plan_s_median (the host planning the
#     GPU waits for each step);
#   - under `ncu --profile-from-start off`, eager, with --cuda-profiler-steps 1: one whole step's
#     kernels, and nothing of the load, the KV fill or the warmup. This goes to
#     $out/ncu-<cell>-level<L>.csv. tools/ncu_layer_table.py turns it into the per-layer table and the
#     step summary (layers x table, and the kernels outside the layers).
# Both go into a titled section per cell of $out/profile.txt. Each process has PROFILE_CELL_S (120)
# or what is left of PROFILE_BUDGET_S. The 32K x 8 full fill puts 34 GB of KV on the GPU (a few
# seconds on an H100). Each cell costs two model loads; a whole `profile` call on a fresh machine
# (kvserve build, checkpoint, three cells at one level) should fit in one 10-minute call. None of this
# has run on a GPU yet (before, `profile` was a launch-skip window of a 1K x 1 step, 15 s a level).
# `run` and `bench` ran as committed on an H100 on 2026-11-26 (docs/gpu.md): `run` 262 s (26 gtests,
# 18 pytest cases, all passed), `bench` 144 s with --budget-s 220. On 2026-11-27 (commit 5acc854) `run`
# took 340 s (30 gtests, 29 pytest cases), the 8B checkpoint 34 s, `kernels` on it 24 s, `prefix` 39 s.
# On 2026-11-27 (commit aad57f2) `run` needed more than 380 s (30 gtests in 36 s, 38 pytest cases in 134 s,
# the rest building), so `all` gives it 450 s.
#
# On 2026-11-29 (H200, commit 33c3bc7) `all` with ALL_BUDGET_S=550 spent it all on `run` (395 s: configure and
# build ~250 s, ctest 39 s, pytest 102 s) and `bench --quick` (125 s): `profile` and what follows need a call
# of their own (PROFILE_CELLS etc. as below), which 15 minutes of device time do not leave.
# `all` is the one call to make on a lent machine (device time is short and a machine goes back after
# 30 s idle): run (the default fused level's pytest cases), bench --quick (the acceptance rows), the
# profile of the two unmet 32K rows (<= 240 s, the cells in order until its time is spent), attention
# (<= 60 s), prefix, then kernels, each in what is left of ALL_BUDGET_S (default 570). By the separate
# calls of 2026-11-28 (run 324 s, bench --quick 117 s) the profile gets ~120 s, about both cells, and
# what follows it little or nothing: a second call, `tools/gpu_check.sh attention`
# (and `prefix`) gets the rest. `all` in this order has not run yet. $out/summary.txt has the headline
# lines, and
# $out/logs.tar.gz everything else (the device tool brings back only a few files per call).
set -euo pipefail
DEPS=.gpudeps
DEBS="libboost1.74-dev libyaml-cpp-dev libyaml-cpp0.7 nlohmann-json3-dev libcli11-dev libspdlog-dev libspdlog1.10
  libfmt-dev libfmt9 libpcre2-dev libpcre2-8-0 libgtest-dev libgmock-dev libgloo-dev libbenchmark-dev
  libbenchmark1debian pkgconf pkgconf-bin libpkgconf3"
WHEELS="openai pydantic pydantic-core distro jiter sniffio annotated-types typing-inspection typing-extensions
  httpx2 httpcore2 truststore anyio h11"

BUILD=/tmp/kvserve-build
out=${OUT:-/tmp/gpu-check}

# The unpacked .debs as a prefix the build and the binary find their headers and libraries in.
setup_env() {
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1
  prefix=/tmp/kvserve-deps; mkdir -p $prefix
  for f in "$DEPS"/*.deb; do dpkg -x "$f" $prefix; done
  lib=$prefix/usr/lib/x86_64-linux-gnu
  export PATH=$prefix/usr/bin:$PATH PKG_CONFIG_SYSROOT_DIR=$prefix
  export PKG_CONFIG_PATH=$lib/pkgconfig:$prefix/usr/share/pkgconfig CPATH=$prefix/usr/include
  export LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  nvidia-smi -L
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
}

# xgrammar's sdist travels in .gpudeps/ too: the GPU machine cannot reach pip's index.
build_kvserve() {
  sdist=$(ls "$PWD/$DEPS"/xgrammar-*.tar.gz 2>/dev/null | head -1 || true)
  ggml=$(ls "$PWD/$DEPS"/ggml-*.tar.gz 2>/dev/null | head -1 || true)
  if [ -n "$ggml" ]; then mkdir -p /tmp/kvserve-ggml && tar xzf "$ggml" -C /tmp/kvserve-ggml; ggml=/tmp/kvserve-ggml/ggml; fi
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix/usr;$lib/cmake;$prefix/usr/share/cmake" \
    ${sdist:+-DKVSERVE_XGRAMMAR_SDIST="$sdist"} ${ggml:+-DKVSERVE_GGML_SOURCE_DIR="$ggml"} > "$out/cmake.log" 2>&1 \
    || { tail -20 "$out/cmake.log"; return 1; }
  [ -z "${KVSERVE_CONFIGURE_ONLY:-}" ] || return 0
  cmake --build "$BUILD" -j "$(nproc)" --target kvserve > "$out/build.log" 2>&1
}

# The steps that run on the bench's 8B checkpoint: kvserve built (first, if `run` has not) and the
# checkpoint made (as `bench` makes it) in $model.
kvserve_and_8b() {
  setup_env
  [ -x "$BUILD/kvserve" ] || build_kvserve
  model=/tmp/kvserve-bench-models/bench-8b
  [ -f "$model/STAMP" ] || python3 bench/bench_gpu.py --child make-model 8b "$model" cuda 1234 > "$out/make8b.log" 2>&1
}

case "${1:-}" in
fetch)
  mkdir -p "$DEPS/whl"
  (cd "$DEPS" && apt-get download $DEBS)
  v=$(sed -n 's/^set(KVSERVE_XGRAMMAR_VERSION \(.*\))/\1/p' cmake/xgrammar.cmake)
  h=$(sed -n 's/^set(KVSERVE_XGRAMMAR_SHA256 \(.*\))/\1/p' cmake/xgrammar.cmake)
  [ -f "$DEPS/xgrammar-$v.tar.gz" ] || python3 tools/fetch_sdist.py xgrammar "$v" "$h" "$DEPS/xgrammar-$v.tar.gz"
  # ggml: the llama-cpp-python sdist (77 MB, over what travels to a GPU machine) checked here, and only
  # its ggml tree without the other backends' sources carried (cmake/ggml.cmake, KVSERVE_GGML_SOURCE_DIR).
  v=$(sed -n 's/^set(KVSERVE_GGML_SDIST_VERSION \(.*\))/\1/p' cmake/ggml.cmake)
  h=$(sed -n 's/^set(KVSERVE_GGML_SDIST_SHA256 \(.*\))/\1/p' cmake/ggml.cmake)
  if [ ! -f "$DEPS/ggml-$v.tar.gz" ]; then
    tmp=$(mktemp -d)
    python3 tools/fetch_sdist.py llama_cpp_python "$v" "$h" "$tmp/sdist.tar.gz"
    tar xzf "$tmp/sdist.tar.gz" -C "$tmp" --strip-components=3 "llama_cpp_python-$v/vendor/llama.cpp/ggml"
    (cd "$tmp/ggml/src" && find . -mindepth 1 -maxdepth 1 -type d ! -name ggml-cpu -exec rm -rf {} +)
    tar czf "$DEPS/ggml-$v.tar.gz" -C "$tmp" ggml
    rm -rf "$tmp"
  fi
  for p in $WHEELS; do
    v=$(python3 -m pip show "$p" 2>/dev/null | awk '/^Version/{print $2}') || v=""
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 -d "$DEPS/whl" "$p${v:+==$v}"
  done
  grep -qx "/$DEPS/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$DEPS/" >> .git/info/exclude; }
  du -sh "$DEPS"
  ;;
run)
  setup_env
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvserve-site "$DEPS"/whl/*.whl
  export PYTHONPATH=/tmp/kvserve-site${PYTHONPATH:+:$PYTHONPATH}
  build_kvserve
  # CUDA gtests: test targets named *cuda* (`--target kvserve` builds no tests; bench_*cuda* are left
  # to their own steps, so that a benchmark that fails to build cannot stop the tests), plus the sampler's
  # (Sampler.SameTokensOnTheDevice), the device tables' and the decode graphs' (DecodeGraphsCuda.*,
  # with the CPU padding tests of the same file) targets.
  cuda_targets=$(cmake --build "$BUILD" --target help 2>/dev/null | sed -e 's/^\.\.\. //' -e 's/:.*//' \
    | grep -i -e cuda -e '^backend_test_sampler$' -e '^cache_manager_test_device_block_tables$' \
      -e '^backend_test_decode_graphs$' -e '^backend_test_fp8_weight$' -e '^backend_test_int4_weight$' -e '^backend_test_int8_weight$' -e '^backend_test_spec_decode$' -e '^cache_manager_test_kv_slabs$' | grep -v -e '[/.]' -e '^bench_' || true)
  if [ -n "$cuda_targets" ]; then
    echo "CUDA gtest targets: $cuda_targets"
    cmake --build "$BUILD" -j "$(nproc)" --target $cuda_targets >> "$out/build.log" 2>&1
    (cd "$BUILD" && ctest -R '[Cc][Uu][Dd][Aa]|OnTheDevice|DeviceBlockTables|DecodeGraph|PaddedDecode|Fp8Weight|Int4Weight|Int8Weight' --output-on-failure) 2>&1 \
      | tee "$out/ctest.log" || rc=1
  else
    echo "no CUDA gtest targets" | tee "$out/ctest.log"
  fi
  python3 tools/make_fixture_models.py --out /tmp/kvserve-fixtures > "$out/fixtures.log" 2>&1
  KVSERVE_BIN=$BUILD/kvserve KVSERVE_FIXTURES=/tmp/kvserve-fixtures \
    python3 -m pytest -q -p no:cacheprovider ${GPU_PYTEST_K:+-k "$GPU_PYTEST_K"} tests/reference/test_cuda_vs_reference.py \
    tests/integration/test_cuda_serving.py 2>&1 | tee "$out/pytest.log" || rc=1
  exit ${rc:-0}
  ;;
bench)
  shift
  setup_env
  [ -x "$BUILD/kvserve" ] || build_kvserve
  # Written into $out as it goes (a run stopped by a time limit still leaves its tables there), then
  # copied to docs/.
  python3 bench/bench_gpu.py --kvserve "$BUILD/kvserve" --out "$out/benchmarks-gpu.md" \
    --json-out "$out/benchmarks-gpu.json" "$@" 2>&1 | tee "$out/bench.log"
  cp "$out/benchmarks-gpu.md" docs/benchmarks-gpu.md
  ;;
prefix)
  shift
  kvserve_and_8b
  python3 bench/bench_prefix_cache.py --kvserve "$BUILD/kvserve" --model "$model" --device cuda --dtype bfloat16 \
    --workloads doc,tier --policies full,pyramidkv --questions 5 --miss-questions 2 --tier-questions 2 \
    --pool 12GiB --tier-pool 1650MiB --tier-bytes 4GiB --json "$out/prefix.json" "$@" 2>&1 | tee "$out/prefix.log"
  ;;
kernels)
  # The decode step's kernels: the fused ops' gtests, then `bench decode` at each KVSERVE_FUSED_OPS
  # level (1 the fused kernels, 0 the torch op chains, 2 the vectorized kernels), interleaved, at batch
  # 1 and 8, each reporting the kernel nodes of its captured step (cuda_graph_stats). KERNELS_MODEL
  # picks the checkpoint (default: models/tiny-llama, whose step is almost all fixed per-kernel cost;
  # `all` passes the 8B one). Sized for ~1 minute after the build.
  shift
  setup_env
  [ -f "$BUILD/build.ninja" ] || KVSERVE_CONFIGURE_ONLY=1 build_kvserve
  cmake --build "$BUILD" -j "$(nproc)" --target kvserve backend_test_fused_ops_cuda >> "$out/build.log" 2>&1
  "$BUILD/tests/backend_test_fused_ops_cuda" > "$out/fused-gtest.log" 2>&1 || rc=1
  tail -3 "$out/fused-gtest.log"
  model=${KERNELS_MODEL:-models/tiny-llama}
  for batch in 1 8; do
    for fused in 1 0 2; do
      KVSERVE_FUSED_OPS=$fused "$BUILD/kvserve" bench decode --model "$model" --device cuda --dtype bfloat16 \
        --context 1024 --batch $batch --steps 64 --warmup 8 "$@" 2>>"$out/kernels.err" | tail -1 \
        > "$out/kernels-b$batch-fused$fused.json" || rc=1
      python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); g=j.get("cuda_graph_stats",{}); print(sys.argv[1].split("/")[-1], "ms/step %.4f" % (j["step_s_median"]*1e3), "kernel nodes", g.get("kernel_nodes"))' \
        "$out/kernels-b$batch-fused$fused.json" || rc=1
    done
  done
  exit ${rc:-0}
  ;;
fp8)
  # Issue 48's GPU row: `--quantization fp8` (e4m3 weights, a scale per output channel, per-token fp8
  # activations, at::_scaled_mm), `int8` (int8 groups of 128, kvserve's few-row kernel) and `int4`
  # (4-bit groups of 128, tinygemm) against bf16 weights on the 8B checkpoint, decode steps at 1K context, batch 1 / 8 / 64, interleaved; the weights-only floors
  # from a device copy's bandwidth.
  shift
  kvserve_and_8b
  bw=$(python3 -c 'import torch; x=torch.empty(2**31, dtype=torch.uint8, device="cuda"); y=torch.empty_like(x); y.copy_(x); torch.cuda.synchronize(); e=[torch.cuda.Event(enable_timing=True) for _ in range(2)]; e[0].record(); [y.copy_(x) for _ in range(10)]; e[1].record(); torch.cuda.synchronize(); print("%.0f" % (2 * 2**31 * 10 / (e[0].elapsed_time(e[1]) / 1e3) / 1e9))')
  echo "device copy: $bw GB/s (read + write)" | tee "$out/fp8.txt"
  for batch in 1 8 64; do
    for q in none fp8 int8 int4; do
      timeout 120 "$BUILD/kvserve" bench decode --model "$model" --device cuda --dtype bfloat16 --quantization $q \
        --context 1024 --batch $batch --steps 16 --warmup 4 --bandwidth-gbs "$bw" "$@" 2>>"$out/fp8.err" | tail -1 \
        > "$out/fp8-b$batch-$q.json" || rc=1
      python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); bw=float(sys.argv[2]); w=j["weight_bytes"]; print("1K x %s, weights %s: %.3f ms/step, %.2f GB of weights, weights-only floor %.3f ms (step / floor %.2fx), floor with KV %.3f ms" % (sys.argv[3], sys.argv[4], j["step_s_median"]*1e3, w/1e9, w/bw/1e6, j["step_s_median"]*1e3/(w/bw/1e6), j["floor_step_s"]*1e3))' \
        "$out/fp8-b$batch-$q.json" "$bw" "$batch" "$q" | tee -a "$out/fp8.txt" || rc=1
    done
  done
  # Prefill: TTFT of one 8K-token prompt per weight format; int4 also with every product on tinygemm
  # (KVSERVE_INT4_DENSE_ROWS=0), the A/B for expanding the weight to bf16 past 64 rows (int8 expands
  # past 16 rows).
  python3 -c 'import json,random; r=random.Random(5); json.dump([[r.randrange(3,2000) for _ in range(8192)]], open("/tmp/fp8-prompt.json","w"))'
  for q in none fp8 int8 int4 int4-tinygemm; do
    rows=64; [ $q = int4-tinygemm ] && rows=0
    KVSERVE_INT4_DENSE_ROWS=$rows timeout 120 "$BUILD/kvserve" generate --model "$model" --device cuda --dtype bfloat16 \
      --quantization "${q%-tinygemm}" --prompts-file /tmp/fp8-prompt.json --max-tokens 2 --ignore-eos --json "$@" \
      2>>"$out/fp8.err" | tail -1 > "$out/fp8-ttft-$q.json" || rc=1
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print("8K prompt, weights %s: TTFT %.3f s" % (sys.argv[2], j["results"][0]["timings"]["time_to_first_token_s"]))' \
      "$out/fp8-ttft-$q.json" $q | tee -a "$out/fp8.txt" || rc=1
  done
  exit ${rc:-0}
  ;;
spec)
  # Issue 49's GPU row: self-speculation (sinks + window, gamma 4) against plain decoding on the 8B
  # checkpoint, SPEC_BATCH prompts (16) of SPEC_CONTEXT random token ids (32768: 64 GiB of bf16 KV),
  # 64 new tokens. The random weights make the acceptance meaningless; the step costs are not: c (a
  # draft step / a plain step) and v (a verify step / a plain step) from generate --json. auto_disable
  # is off so that the random drafts' rejections do not pause the steps being measured.
  shift
  kvserve_and_8b
  python3 -c 'import json,random,sys; r=random.Random(7); n,b=int(sys.argv[1]),int(sys.argv[2]); json.dump([[r.randrange(3,2000) for _ in range(n)] for _ in range(b)], open("/tmp/spec-prompts.json","w"))' \
    "${SPEC_CONTEXT:-32768}" "${SPEC_BATCH:-16}"
  : > "$out/spec.txt"
  for mode in plain self; do
    cfg=(); [ $mode = self ] && cfg=(--speculative-config '{"method": "self", "num_speculative_tokens": 4, "auto_disable": false}')
    timeout 240 "$BUILD/kvserve" generate --model "$model" --device cuda --dtype bfloat16 --prompts-file /tmp/spec-prompts.json \
      --max-tokens 64 --ignore-eos --json "${cfg[@]}" "$@" 2>>"$out/spec.err" | tail -1 \
      > "$out/spec-$mode.json" || rc=1
  done
  python3 - "$out/spec-plain.json" "$out/spec-self.json" <<'PY' | tee -a "$out/spec.txt" || rc=1
import json, sys
p, s = (json.load(open(f)) for f in sys.argv[1:3])
def rate(j):
    rs = j["results"]
    return sum(r["completion_tokens"] - 1 for r in rs) / max(r["timings"]["decode_s"] for r in rs)
plain_step = max(r["timings"]["decode_s"] / (r["completion_tokens"] - 1) for r in p["results"])
sp = s.get("speculative", {})
print(f"plain {rate(p):.0f} tok/s (step {plain_step * 1e3:.2f} ms); self {rate(s):.0f} tok/s = {rate(s) / rate(p):.2f}x; "
      f"acceptance {sp.get('acceptance_rate')}, mean accepted length {sp.get('mean_acceptance_length')}")
if sp.get("draft_steps"):
    print(f"c = {sp['draft_s'] / sp['draft_steps'] / plain_step:.2f} (draft step {sp['draft_s'] / sp['draft_steps'] * 1e3:.2f} ms), "
          f"v = {sp['verify_s'] / sp['verify_steps'] / plain_step:.2f} (verify step {sp['verify_s'] / sp['verify_steps'] * 1e3:.2f} ms)")
PY
  exit ${rc:-0}
  ;;
kvquant)
  # Issue 47's GPU row: quantized KV pools (int8 = q8_0, int4 = q4_0 rows, read by the quantized decode
  # kernel) against bf16 on the 8B checkpoint: full 1K x 8 and 32K x 8, pyramidkv-128 32K x 64, bench
  # decode, interleaved. The floors with KV come from a device copy's bandwidth and each pool's bytes.
  shift
  kvserve_and_8b
  bw=$(python3 -c 'import torch; x=torch.empty(2**31, dtype=torch.uint8, device="cuda"); y=torch.empty_like(x); y.copy_(x); torch.cuda.synchronize(); e=[torch.cuda.Event(enable_timing=True) for _ in range(2)]; e[0].record(); [y.copy_(x) for _ in range(10)]; e[1].record(); torch.cuda.synchronize(); print("%.0f" % (2 * 2**31 * 10 / (e[0].elapsed_time(e[1]) / 1e3) / 1e9))')
  echo "device copy: $bw GB/s (read + write)" | tee "$out/kvquant.txt"
  for cell in 1024:8:full 32768:8:full 32768:64:pyramidkv:128; do
    IFS=: read -r ctx batch policy budget <<< "$cell"
    for kv in auto int8 int4; do
      timeout 150 "$BUILD/kvserve" bench decode --model "$model" --device cuda --dtype bfloat16 --kv-cache-dtype $kv \
        --context $ctx --batch $batch --policy $policy ${budget:+--budget $budget} --steps 16 --warmup 4 \
        --bandwidth-gbs "$bw" "$@" 2>>"$out/kvquant.err" | tail -1 > "$out/kvquant-$ctx-$batch-$policy-$kv.json" || rc=1
      python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print("%s x %s %s, KV %s: %.3f ms/step, %.0f tok/s, floor with KV %.3f ms (step / floor %.2fx)" % (sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], j["step_s_median"]*1e3, j["decode_tokens_per_s"], j["floor_step_s"]*1e3, j["step_s_median"]/j["floor_step_s"]))' \
        "$out/kvquant-$ctx-$batch-$policy-$kv.json" "$ctx" "$batch" "$policy" "$kv" | tee -a "$out/kvquant.txt" || rc=1
    done
  done
  exit ${rc:-0}
  ;;
ttft)
  # Issue 13's TTFT row (8 prompts of 8K tokens, full; kvserve 2.17 s against transformers' 2.14 s on an
  # H200, 2026-11-29): time to first token of all 8 with 1, 2, 4 and 8 prompts' tokens per prefill step
  # (--max-num-batched-tokens 8192 .. 65536; prefill_batch runs the prompts of a step in one forward).
  shift
  kvserve_and_8b
  python3 -c 'import json,random; r=random.Random(3); json.dump([[r.randrange(3,2000) for _ in range(8192)] for _ in range(8)], open("/tmp/ttft-prompts.json","w"))'
  : > "$out/ttft.txt"
  for tokens in 8192 16384 32768 65536; do
    timeout 120 "$BUILD/kvserve" generate --model "$model" --device cuda --dtype bfloat16 --prompts-file /tmp/ttft-prompts.json \
      --max-tokens 4 --ignore-eos --json --max-num-batched-tokens $tokens "$@" 2>>"$out/ttft.err" | tail -1 > "$out/ttft-$tokens.json" || rc=1
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); t=[r["timings"]["time_to_first_token_s"] for r in j["results"]]; print("max_num_batched_tokens %s: TTFT first %.3f s, all %.3f s, load %.1f s" % (sys.argv[2], min(t), max(t), j["load_s"]))' \
      "$out/ttft-$tokens.json" $tokens | tee -a "$out/ttft.txt" || rc=1
  done
  exit ${rc:-0}
  ;;
attention)
  # The decode attention variants' sweep (see the top of this file).
  shift
  t_att=$(date +%s)
  setup_env
  [ -f "$BUILD/build.ninja" ] || KVSERVE_CONFIGURE_ONLY=1 build_kvserve
  cmake --build "$BUILD" -j "$(nproc)" --target bench_paged_decode_cuda >> "$out/build.log" 2>&1 \
    || { echo "bench_paged_decode_cuda failed to build:"; tail -30 "$out/build.log"; exit 1; }
  sweep_s=55
  if [ -n "${ATTENTION_BUDGET_S:-}" ]; then
    sweep_s=$(( ATTENTION_BUDGET_S - ($(date +%s) - t_att) )); [ $sweep_s -ge 15 ] || sweep_s=15
  fi
  echo "built in $(( $(date +%s) - t_att )) s; sweep budget $sweep_s s"
  # The .md and .json are rewritten after every cell: a run cut short still leaves its cells.
  "$BUILD/bench/bench_paged_decode_cuda" --out "$out/paged-decode-sweep.md" --json "$out/paged-decode-sweep.json" \
    --budget-s $sweep_s "$@" > /dev/null 2> "$out/paged-decode-sweep.err" || rc=1
  cat "$out/paged-decode-sweep.md" 2>/dev/null
  tail -20 "$out/paged-decode-sweep.err"
  exit ${rc:-0}
  ;;
profile)
  # Per-kernel tables of whole decode steps (issue 34), for each cell of PROFILE_CELLS (see the top of
  # this file), cheapest first, at each fused level of PROFILE_LEVELS.
  shift
  t_prof=$(date +%s)
  setup_env
  [ -x "$BUILD/kvserve" ] || build_kvserve
  model=${PROFILE_MODEL:-/tmp/kvserve-bench-models/bench-8b}
  [ -n "${PROFILE_MODEL:-}" ] || [ -f "$model/STAMP" ] \
    || python3 bench/bench_gpu.py --child make-model 8b "$model" cuda 1234 > "$out/make8b.log" 2>&1
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
  [ -n "$ncu" ] || { echo "no ncu on this machine" | tee "$out/profile.txt"; exit 1; }
  : > "$out/profile.txt"
  # Each process gets PROFILE_CELL_S, or what is left of PROFILE_BUDGET_S when that is less.
  cell_s() {
    local s=${PROFILE_CELL_S:-120} l
    if [ -n "${PROFILE_BUDGET_S:-}" ]; then
      l=$(( PROFILE_BUDGET_S - ($(date +%s) - t_prof) ))
      if [ $l -lt $s ]; then s=$l; fi
    fi
    echo $s
  }
  for cell in ${PROFILE_CELLS:-1024:1:full 32768:8:full 32768:64:pyramidkv:128}; do
    IFS=: read -r ctx batch policy budget <<< "$cell"
    name=$ctx-$batch-$policy${budget:+-$budget}
    pflags=""; [ "$policy" = full ] || pflags="--policy $policy${budget:+ --budget $budget}"
    bench="$BUILD/kvserve bench decode --model $model --device cuda --dtype bfloat16 --context $ctx --batch $batch $pflags"
    echo "## $ctx x $batch, $policy${budget:+ budget $budget}" >> "$out/profile.txt"
    for level in ${PROFILE_LEVELS:-2}; do
      [ "$(cell_s)" -ge 20 ] || { echo "(no time left for level $level)" >> "$out/profile.txt"; rc=1; continue; }
      # The real step first (CUDA graphs, no ncu): what the table below should add up to, and the host
      # planning the GPU waits for every step.
      KVSERVE_FUSED_OPS=$level timeout "$(cell_s)" $bench --steps 16 --warmup 4 "$@" 2>> "$out/profile.err" | tail -1 \
        > "$out/graphs-$name-level$level.json" || rc=1
      python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print("graphs, KVSERVE_FUSED_OPS=%s: step_s_median %.3f ms, host_plan_s_median %.3f ms, fill %.1f s" % (sys.argv[2], j["step_s_median"]*1e3, j.get("host_plan_s_median", float("nan"))*1e3, j["fill_s"]))' \
        "$out/graphs-$name-level$level.json" "$level" >> "$out/profile.txt" 2>&1 || rc=1
      [ "$(cell_s)" -ge 20 ] || { echo "(no time left for ncu at level $level)" >> "$out/profile.txt"; rc=1; continue; }
      # One eager step inside the profiler range: ncu profiles nothing of the load, fill or warmup.
      KVSERVE_FUSED_OPS=$level timeout "$(cell_s)" "$ncu" --profile-from-start off --metrics gpu__time_duration.sum \
        --csv --page raw $bench --enforce-eager --steps 2 --warmup 1 --cuda-profiler-steps 1 "$@" \
        > "$out/ncu-$name-level$level.csv" 2> "$out/ncu-$name-level$level.err" || rc=1
      echo "### KVSERVE_FUSED_OPS=$level: ncu, eager, one step" >> "$out/profile.txt"
      python3 tools/ncu_layer_table.py "$out/ncu-$name-level$level.csv" >> "$out/profile.txt" 2>&1 || rc=1
    done
  done
  cat "$out/profile.txt"
  exit ${rc:-0}
  ;;
all)
  shift
  set +e  # a step that fails or runs out of time is reported in summary.txt; the next one still runs
  t0=$(date +%s)
  budget=${ALL_BUDGET_S:-570}
  sum="$out/summary.txt"; mkdir -p "$out"; : > "$sum"
  step() { echo "$1 rc=$2 at $(( $(date +%s) - t0 )) s" | tee -a "$sum"; }
  left() { echo $(( budget - ($(date +%s) - t0) )); }
  # The CUDA pytest cases at the default fused level only (the other two levels: `run` with
  # GPU_PYTEST_K="torch-ops or fused-ops"); 324 s on an H100 on 2026-11-28, before the three
  # speculative-decoding cases (6 generate processes) joined test_cuda_serving.py.
  GPU_PYTEST_K=${GPU_PYTEST_K-"not torch-ops and not fused-ops"} timeout 440 "$0" run > "$out/run.out" 2>&1; step run $?
  { tail -3 "$out/ctest.log"; grep -E "passed|failed" "$out/pytest.log" | tail -2;
    grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20; } >> "$sum" 2>/dev/null
  # The acceptance rows next (the quick bench makes the 8B checkpoint the later steps reuse): ~120 s.
  if [ "$(left)" -gt 100 ]; then
    timeout $(( $(left) < 160 ? $(left) : 160 )) "$0" bench --quick --budget-s 120 > "$out/bench.out" 2>&1; step bench $?
    grep -A8 "^## Acceptance" "$out/benchmarks-gpu.md" >> "$sum" 2>/dev/null
  fi
  model=/tmp/kvserve-bench-models/bench-8b
  [ -f "$model/STAMP" ] || timeout 150 python3 bench/bench_gpu.py --child make-model 8b "$model" cuda 1234 \
    > "$out/make8b.log" 2>&1; step make8b $?
  # fp8, int8 and int4 weights against bf16 (issue 48): twelve short bench decode processes and five
  # 8K prefills, ~190 s.
  [ "$(left)" -gt 60 ] && { timeout $(( $(left) < 220 ? $(left) : 220 )) "$0" fp8 > "$out/fp8.out" 2>&1; step fp8 $?; }
  grep -E "device copy|ms/step|TTFT" "$out/fp8.txt" >> "$sum" 2>/dev/null
  # Self-speculation against plain decoding at 32K x 16 (issue 49): two generate runs, ~2-3 minutes.
  [ "$(left)" -gt 150 ] && { timeout $(( $(left) < 240 ? $(left) : 240 )) "$0" spec > "$out/spec.out" 2>&1; step spec $?; }
  cat "$out/spec.txt" >> "$sum" 2>/dev/null
  # The per-kernel tables of the two unmet 32K rows at the default level, right after the rows
  # themselves (the 1K x 1 table ran on 2026-11-28 (commit 5834135); PROFILE_CELLS / PROFILE_LEVELS override); each
  # cell's processes have at most 120 s.
  [ "$(left)" -gt 40 ] && { t_prof=$(( $(left) < 240 ? $(left) : 240 ))
    PROFILE_CELLS=${PROFILE_CELLS:-"32768:8:full 32768:64:pyramidkv:128"} PROFILE_BUDGET_S=$(( t_prof - 5 )) \
    PROFILE_LEVELS=${PROFILE_LEVELS:-2} timeout $t_prof "$0" profile > "$out/profile.out" 2>&1; step profile $?; }
  grep -E "^## |^graphs,|kernel time per step|layer table x|outside the layer periods" "$out/profile.txt" >> "$sum" 2>/dev/null
  # The decode attention variants' sweep: ~20 s to build its binary, then <= 40 s of sweep.
  [ "$(left)" -gt 45 ] && { t_att=$(( $(left) < 60 ? $(left) : 60 ))
    ATTENTION_BUDGET_S=$(( t_att - 5 )) timeout $t_att "$0" attention > "$out/attention.out" 2>&1; step attention $?; }
  grep -B2 -A12 "^| context | batch | default" "$out/paged-decode-sweep.md" >> "$sum" 2>/dev/null
  [ "$(left)" -gt 45 ] && { timeout $(( $(left) < 150 ? $(left) : 150 )) "$0" prefix > "$out/prefix.out" 2>&1; step prefix $?; }
  grep -A30 "^| policy" "$out/prefix.log" >> "$sum" 2>/dev/null
  # The fused-kernel A/B last: it ran on 2026-11-28 (commit 5834135) (level 2 is the default since).
  [ "$(left)" -gt 40 ] && { KERNELS_MODEL=$model timeout $(( $(left) < 90 ? $(left) : 90 )) "$0" kernels > "$out/kernels.out" 2>&1; step kernels $?; }
  grep -E "ms/step|PASSED|FAILED" "$out/kernels.out" >> "$sum" 2>/dev/null
  tar czf /tmp/gpu-logs.tar.gz -C "$out" --exclude summary.txt --exclude benchmarks-gpu.md . && mv /tmp/gpu-logs.tar.gz "$out/logs.tar.gz"
  find "$out" -maxdepth 1 -type f ! -name summary.txt ! -name logs.tar.gz ! -name benchmarks-gpu.md ! -name profile.txt \
    ! -name 'paged-decode-sweep.*' -delete
  cat "$sum"
  ;;
*)
  echo "usage: tools/gpu_check.sh fetch|run|bench|prefix|kernels|attention|profile|fp8|spec|ttft|kvquant|all [options]" >&2; exit 2 ;;
esac
