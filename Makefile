# The two entry points of the README. Each creates .venv if missing and installs CPU torch first
# (a range or an unpinned torch would pull a multi-GB CUDA build), then the pinned project.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ferry-installed

.PHONY: run test install bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	$(BIN)/pip install --disable-pip-version-check -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/ferry models fetch smollm2
	$(BIN)/ferry serve --config deploy/serve.yaml

# Two pytest workers (pytest-xdist), each test file whole on one of them: its module fixtures (a
# Serve app, a multi-node cluster) stay in one process, and each worker has its own Ray cluster.
# Much of a Ray test is waiting on other processes, so two workers fit 2 cores; TEST_WORKERS=0 runs
# in this process only.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

bench: $(STAMP)
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info
