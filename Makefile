# Set-up and the two everyday commands. Both create .venv on first use.
# torch is installed pinned *first*: an open range would pull the multi-GB CUDA build.
# Every install is held to constraints.txt (the versions the tests passed with), so two fresh
# machines get the same packages; `make test-latest` tries the newest releases in .venv-latest.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.13.0
PINS    := constraints.txt
EXTRAS  := .[dev,plot,triton,models]
STAMP   := $(VENV)/.installed
LATEST  := .venv-latest
# what test-latest installs as torch (e.g. "torch --index-url https://download.pytorch.org/whl/cpu")
TORCH_LATEST ?= torch
# what test-latest runs (e.g. PYTEST_ARGS="tests/unit -x" for a quicker look)
PYTEST_ARGS ?= tests

.PHONY: demo test test-fast test-latest constraints lint mutation clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml $(PINS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c $(PINS) --upgrade pip
	$(BIN)/pip install -q -c $(PINS) $(TORCH)
	$(BIN)/pip install -q -c $(PINS) -e "$(EXTRAS)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mixmoe demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

# the cheap tiers (unit, kernels, hf; no multi-process or slow test): a few minutes, before a commit
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not dist and not slow and not gpu"

# The suite on the newest releases of every dependency (a separate venv; the pins stay as they
# are), then what changed against constraints.txt. Exits with pytest's status. torch and the
# extras resolve in ONE pip call: alone, the newest torch may need an older triton than the extra
# allows, and pip would then swap it back, leaving its CUDA wheels behind.
test-latest:
	test -x $(LATEST)/bin/python || $(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --upgrade pip
	$(LATEST)/bin/pip install -q --upgrade --upgrade-strategy eager $(TORCH_LATEST) -e "$(EXTRAS)"
	$(LATEST)/bin/pip freeze --all --exclude-editable > $(LATEST)/freeze.txt
	$(LATEST)/bin/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	$(PY) scripts/constraints.py diff $(PINS) $(LATEST)/freeze.txt; exit $$rc

# Rewrite constraints.txt from .venv (after the tests passed there on new versions).
constraints: $(STAMP)
	$(BIN)/pip freeze --all --exclude-editable | $(PY) scripts/constraints.py write > $(PINS)

lint: $(STAMP)
	$(BIN)/ruff check mixmoe tests
	$(BIN)/ruff format --check mixmoe tests

# Mutation testing of the core (slow, not in CI): MUTATION_GROUPS="gating ops" for a subset.
# Edits the sources in place while it runs; prints kill rates and survivors (docs/mutation-log.md).
mutation: $(STAMP)
	$(BIN)/python scripts/mutation/run_mutation.py $(MUTATION_GROUPS)

clean:
	rm -rf $(VENV) $(LATEST) build *.egg-info .mutmut-cache .mutmut-logs
