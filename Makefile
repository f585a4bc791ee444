# Set-up and the two everyday commands. Both create .venv on first use.
# torch is installed pinned *first*: an open range would pull the multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: demo test test-fast lint mutation clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev,plot,triton,models]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mixmoe demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

# the cheap tiers (unit, kernels, hf; no multi-process or slow test): a few minutes, before a commit
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not dist and not slow and not gpu"

lint: $(STAMP)
	$(BIN)/ruff check mixmoe tests
	$(BIN)/ruff format --check mixmoe tests

# Mutation testing of the core (slow, not in CI): MUTATION_GROUPS="gating ops" for a subset.
# Edits the sources in place while it runs; prints kill rates and survivors (docs/mutation-log.md).
mutation: $(STAMP)
	$(BIN)/python scripts/mutation/run_mutation.py $(MUTATION_GROUPS)

clean:
	rm -rf $(VENV) build *.egg-info .mutmut-cache .mutmut-logs
