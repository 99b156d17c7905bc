# gradsync — two commands on a fresh machine: `make test` and `make demo`.
# Both depend on `make install`, which is idempotent: a second run takes seconds.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATASET := /usr/share/datasets/fashion-mnist
CORPUS := /usr/share/games/fortunes
# Parallel test workers: pytest-xdist; multi-rank tests spawn their own processes.
TEST_WORKERS ?= 2

.PHONY: install test test-all coverage mutations lint demo bench bench-check gpu-check gpu-bench clean

install: $(STAMP) dataset

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null
	# gradsync needs no torchvision. An earlier set-up installed the PyPI wheel, whose CUDA-linked
	# C++ ops cannot load with the CPU torch: its import (and torchmetrics', Lightning's,
	# transformers' model classes') then fails. Remove it.
	$(PY) -m pip uninstall -q -y torchvision 2>/dev/null || true
	# torch==2.13.0 is served by the local CPU wheel; constraints.txt pins the releases the
	# tests run with, while the package itself asks only for torch>=2.11. One resolution.
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0" -e ".[dev]"
	@touch $(STAMP)

# Real data from Debian, when we are root and it is missing: Fashion-MNIST for the vision
# models, the fortunes text collection as the offline corpus of the language models.
APT_GET = apt-get install -y -q --no-install-recommends
dataset:
	@for pair in "$(DATASET):dataset-fashion-mnist" "$(CORPUS):fortunes"; do \
	  dir=$${pair%%:*}; pkg=$${pair##*:}; \
	  if [ ! -d $$dir ]; then \
	    if [ "$$(id -u)" = 0 ]; then \
	      ($(APT_GET) $$pkg >/dev/null 2>&1 || \
	       (apt-get update -q >/dev/null && $(APT_GET) $$pkg >/dev/null)) \
	       || echo "warning: could not install $$pkg; gradsync falls back only where asked to"; \
	    else echo "note: not root; skipping $$pkg (apt-get install $$pkg to use the real data)"; fi; \
	  fi; \
	done

# One pass. The accelerators' kernels and path (which CI has no GPU to run) are a parameter of
# the tests that depend on them (tests/conftest.py, the kernels fixture), and the ranks of
# multi-rank tests are reused across the session (gradsync.testing.pool).
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow" tests

# Everything, the slow benchmarks and studies included.
test-all: install
	$(PY) -m pytest -n $(TEST_WORKERS) tests

# Line coverage of src/gradsync per layer (the rank processes included), printed by
# .ci/coverage_layers.py; the data goes to .coverage-data/.
coverage: install
	rm -rf .coverage-data && mkdir -p .coverage-data
	$(VENV)/bin/coverage run -m pytest -n $(TEST_WORKERS) -m "not slow" -q tests
	$(VENV)/bin/coverage combine -q
	$(PY) .ci/coverage_layers.py --json .coverage-data/layers.json \
	  --against docs/results/coverage-0f2bd88.json

# One mutation per layer (a sign, an index, a comparison): each must fail its layer's tests.
mutations: install
	$(PY) .ci/mutations.py

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/lint-imports --no-cache

demo: install
	$(PY) -m gradsync demo

bench: install
	$(PY) -m gradsync bench sparsify

# The timing regression check (gradsync.apps.bench.check): collectives and training steps as
# ratios to a dense reference timed in the same run, against .ci/bench-baseline.json; a
# failing figure is measured once more before it fails. Under a minute; CI runs it after the
# tests, never inside them.
bench-check: install
	$(PY) -m gradsync bench check

# The GPU path (docs/architecture.md, "GPU path"): the tests marked `cuda` — collectives, engine,
# DDP hook and TAGC on CUDA, NCCL at P = 1 (and on every GPU where there are several), gloo on
# CUDA tensors at P = 2, 3. Needs a CUDA build of torch: GPU_PY=/path/to/python to use another
# interpreter than the venv's (whose pinned wheel is the CPU one); the package is taken from
# src/, so that interpreter needs torch and the test dependencies, not gradsync installed.
# Fails where CUDA is absent.
GPU_PY ?= $(PY)
gpu-check: export PYTHONPATH := $(CURDIR)/src:$(CURDIR)/tests$(if $(PYTHONPATH),:$(PYTHONPATH))
gpu-check:
	@$(GPU_PY) -c "import sys, torch; ok = torch.cuda.is_available(); \
	print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| NCCL', \
	      '.'.join(map(str, torch.cuda.nccl.version())) if ok else 'n/a'); \
	[print('device', i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) \
	 for i in range(torch.cuda.device_count())]; \
	ok or sys.exit('gpu-check: no CUDA device visible to this torch; nothing was run')"
	$(GPU_PY) -m pytest -v -m cuda tests/test_cuda.py

# A lent GPU's whole visit as one prepared run (about 10 min with the machine's start inside a
# 15-min allowance): gpu-check's tests, then `bench overhead` (ResNet-50 and GPT-2, every
# scheme against DDP) fitted into GPU_BENCH_S seconds. Logs, JSON and page go under GPU_OUT
# (point it at the device tool's $$OUT so they come back); CODE=<commit> names the code on the
# page, since the checkout travels there without its history.
GPU_OUT ?= bench-out/gpu
GPU_BENCH_S ?= 450
gpu-bench: export PYTHONPATH := $(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH))
gpu-bench:
	mkdir -p $(GPU_OUT)
	$(MAKE) --no-print-directory gpu-check GPU_PY=$(GPU_PY) 2>&1 | tee $(GPU_OUT)/gpu-check.log
	set -o pipefail; $(GPU_PY) -m gradsync bench overhead --time-limit $(GPU_BENCH_S) \
	  $(if $(CODE),--code $(CODE)) --out $(GPU_OUT) 2>&1 | tee $(GPU_OUT)/overhead.log

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache bench-out .coverage-data
