# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test quick soak demo bench lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Full install once (all extras + dev tools); strict editable mode so mypy can follow the package.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[all,dev]" --config-settings editable_mode=strict
	touch $(STAMP)

# Strict editable installs link each module: re-link (no deps, seconds) so new modules are seen.
install: $(STAMP)
	$(BIN)/pip install --quiet --no-deps -e . --config-settings editable_mode=strict

lint: install
	$(BIN)/ruff check manager handlers tests examples bench
	$(BIN)/ruff format --check manager handlers tests examples bench
	$(BIN)/mypy -p cairn.manager -p cairn.handlers

test: lint
	$(BIN)/python -m pytest -q

soak: install
	$(BIN)/python -m pytest -q -m slow

demo: install
	$(BIN)/python examples/train_and_resume.py

# The train-state benchmark (cairn vs orbax-checkpoint vs memcpy and write+fsync, ~5 min here);
# bench/bench_save_restore.py is the older NumPy-leaf benchmark.
bench: install
	$(BIN)/python bench/bench_train_state.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
