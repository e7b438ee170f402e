# One entry per job. `make test` builds its own virtual environment first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench services tools clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test,lint]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m demo

services:
	bash scripts/services.sh

tools:
	bash scripts/tools.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(STAMP) services tools lint
	$(BIN)/python -m pytest

bench: $(STAMP) services
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache demo/var
