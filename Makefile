# kvmesh: `make demo` installs into .venv and runs the main job; `make test` runs the whole suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install peers demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test,ucx]' --config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python run_cluster.py demo

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The peer tools the agreement tests run against (sgl-router, AIPerf), each in a virtualenv of its own, installed
# with pip when missing (as bench/router.py and bench/aiperf.py do); without a package index they stay missing and
# those tests skip, saying why.
peers: $(STAMP)
	$(BIN)/python -c "from bench.router import sglang_python; from bench.aiperf import aiperf_bin; \
	sglang_python(install=True); aiperf_bin(install=True)"

test: $(STAMP) peers
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit tests/property

bench: $(STAMP)
	for b in bench/[a-z]*.py; do $(BIN)/python $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .venv-sglang .venv-aiperf .pytest_cache .mypy_cache .ruff_cache .hypothesis
