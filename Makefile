# Two entry points, each building its own virtual environment on first use:
#   make demo   install semipack and explain the embedded sentence encoder (semipack explain)
#   make test   install semipack with its test dependencies and run the whole test suite
#   (make lint: its ruff checks alone)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test lint bench clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	touch $@

$(VENV)/.demo: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q -e '.[explain]'
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(VENV)/.bench: $(VENV)/.test
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

demo: $(VENV)/.demo
	$(PY) -m semipack explain --out explain_out

lint: $(VENV)/.test
	$(PY) -m ruff check semipack tests examples benchmarks
	$(PY) -m ruff format --check semipack tests examples benchmarks

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 -p no:cacheprovider

bench: $(VENV)/.bench
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
