# The two quick-start commands: `make train` (the main job) and `make test`; also gpu-check and format.
# Each creates .venv when it is missing and installs into it what it needs: `make train` the package
# (`pip install -e .`, what training needs), the other targets the dev extras too (`.[dev]`: tests,
# ONNX, GradCAM, streaming). Each install is redone when pyproject.toml changes (a stamp file each),
# and a .venv whose Python is older than pyproject's requires-python is made again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.yaml
# `make test` runs the suite in this many pytest-xdist processes, one torch thread each (tests/conftest.py).
TEST_WORKERS ?= 2
# The oldest Python the project takes: pyproject.toml's `requires-python = ">=X.Y"`.
MIN_PYTHON := $(shell sed -n 's/^requires-python = ">=\([0-9.]*\)"/\1/p' pyproject.toml)
# Exits 0 when the Python $(1) runs and is at least MIN_PYTHON.
python_ok = $(1) -c 'import sys; sys.exit(sys.version_info < tuple(map(int, "$(MIN_PYTHON)".split("."))))' 2>/dev/null
python_version = $$($(1) -c 'import platform; print(platform.python_version())' 2>/dev/null || echo "none that runs")

.PHONY: train test lint format clean-venv gpu-check

$(VENV)/.installed-train: pyproject.toml
	@test -n "$(MIN_PYTHON)" || { echo 'error: pyproject.toml has no requires-python = ">=X.Y" line' >&2; exit 1; }
	@if ! $(call python_ok,$(PY)); then \
	  if ! $(call python_ok,$(PYTHON)); then \
	    echo "error: $(PYTHON) is Python $(call python_version,$(PYTHON)), this project needs >= $(MIN_PYTHON): name a newer one, e.g. make PYTHON=python3.11" >&2; \
	    exit 1; \
	  fi; \
	  if [ -e $(VENV) ]; then \
	    echo "$(VENV) has Python $(call python_version,$(PY)), not >= $(MIN_PYTHON): making it again with $(PYTHON)"; \
	    rm -rf $(VENV); \
	  fi; \
	  echo "$(PYTHON) -m venv $(VENV)"; \
	  $(PYTHON) -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-train
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

train: $(VENV)/.installed-train
	$(PY) scripts/train.py fit --config $(CONFIG)

test: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# The GPU paths (bf16 fits, compile, flash attention, sharded and NCCL DDP, streaming data): a table; without a GPU it says so.
gpu-check: $(VENV)/.installed-dev
	$(PY) scripts/gpu_check.py

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed-dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean-venv:
	rm -rf $(VENV)
