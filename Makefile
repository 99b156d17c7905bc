# gradsync — two commands on a fresh machine: `make test` and `make demo`.
# Both depend on `make install`, which is idempotent: a second run takes seconds.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATASET := /usr/share/datasets/fashion-mnist
# Parallel test workers: pytest-xdist; multi-rank tests spawn their own processes.
TEST_WORKERS ?= 2

.PHONY: install test lint demo bench clean

install: $(STAMP) dataset

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null
	# torch==2.13.0 is served by the local CPU wheel (pinned in pyproject.toml).
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

# Real Fashion-MNIST from Debian, when we are root and it is missing.
dataset:
	@if [ ! -d $(DATASET) ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q dataset-fashion-mnist >/dev/null)) \
	     || echo "warning: could not install dataset-fashion-mnist; training falls back to synthetic data"; \
	  else echo "note: not root; skipping dataset-fashion-mnist (install it with apt to use real data)"; fi; \
	fi

test: install
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow" tests

lint: install
	$(VENV)/bin/ruff check src tests

demo: install
	$(PY) -m gradsync demo

bench: install
	$(PY) -m gradsync bench sparsify

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache bench-out
