# One entry per job. `make check` and `make test` build their own virtual environment
# first; `check` runs in it, and nox (noxfile.py) builds one more per session of the
# support matrix.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every stage is timed, and stopped if it runs far past its recorded figure (a hang):
# scripts/stages.py, which prints the table of them at the end of `make test`.
STAGE := $(PYTHON) scripts/stages.py run
export OUTBOX_STAGES ?= $(CURDIR)/build/stages

.PHONY: demo check test matrix lint bench services tools clean lock

# The tools (ruff, mypy, pytest, nox, uv...) and every other release the venv holds
# come from the lock, so a fresh machine today, tomorrow and in CI checks with the same
# ones; `make lock` resolves it again (an update is a commit). The venv's wheelhouse
# holds what the package check installs offline (scripts/check_package.py).
LOCK := requirements/check.txt
$(STAMP): pyproject.toml $(LOCK)
	$(STAGE) "venv" -- sh -c "$(PYTHON) -m venv $(VENV) && \
	  $(BIN)/pip install --quiet --disable-pip-version-check -c $(LOCK) -e '.[test,lint,dev]' && \
	  $(BIN)/python scripts/check_package.py --wheelhouse"
	touch $(STAMP)

lock: $(STAMP)
	$(BIN)/uv pip compile pyproject.toml --all-extras --universal \
	  --python-version 3.10 --quiet --upgrade -o $(LOCK)

# The demo needs only the package itself (Django, Celery, kombu): a venv of its own.
DEMO_VENV := .venv-demo
$(DEMO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install --quiet --disable-pip-version-check -e .
	touch $@

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/python -m demo

services:
	$(STAGE) "services" -- bash scripts/services.sh

tools:
	$(STAGE) "tools" -- bash scripts/tools.sh

lint: $(STAMP)
	$(STAGE) "check: lint and types" -- sh -c \
	  "$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy"

# The fast check: lint, types, every test that needs no server (tests/servers.py says
# which; their server addresses point nowhere), then the sdist and the wheel built,
# checked and installed into a fresh venv (scripts/check_package.py). No server is
# needed and nothing is downloaded once the venv exists.
check: lint
	$(STAGE) "check: tests without servers" -- env OUTBOX_TEST_SERVERS=none $(BIN)/pytest -q
	$(STAGE) "check: package" -- $(BIN)/python scripts/check_package.py

# Everything: the Debian programs (the fast check runs promtool on deploy/; in CI a
# missing one fails the test), the fast check, then the support matrix; then the table
# of where the time went (each stage beside its recorded figure, the slowest tests).
test:
	@$(PYTHON) scripts/stages.py clear
	@status=0; $(MAKE) --no-print-directory tools check matrix || status=1; \
	$(PYTHON) scripts/stages.py report || status=1; exit $$status

# The support matrix (noxfile.py, run by scripts/matrix.py): the whole suite on the
# newest versions (on pytest-xdist) and the contract tests of every other pair, sharing
# a pool of slots; then the serial tests (they stop RabbitMQ and the databases) alone.
# Every session runs even when an earlier one failed; any failure fails the target.
# Lint, types and the package are `check`'s, not repeated here.
matrix: $(STAMP) services tools
	$(BIN)/python scripts/matrix.py

bench: $(STAMP) services
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) $(DEMO_VENV) .nox .mypy_cache .ruff_cache .pytest_cache demo/var
