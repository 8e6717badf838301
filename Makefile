# The two quick-start commands: `make train` (the main job) and `make test`; also gpu-check and format.
# Both create .venv and install the package into it when it is missing or pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.yaml
# `make test` runs the suite in this many pytest-xdist processes, one torch thread each (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: train test lint format clean-venv gpu-check

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

train: $(VENV)/.installed
	$(PY) scripts/train.py fit --config $(CONFIG)

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# The GPU paths (bf16 fits, compile, flash attention, sharded and NCCL DDP): a table; without a GPU it says so.
gpu-check: $(VENV)/.installed
	$(PY) scripts/gpu_check.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean-venv:
	rm -rf $(VENV)
