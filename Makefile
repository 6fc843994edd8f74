# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test quick soak lower-bounds demo bench bench-overhead bench-first-save bench-incremental bench-multitier orbax-suite lint clean

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

# Two workers (this machine's 2 cores), a test file each at a time: its module fixtures (the
# moto and fake-gcs servers, TensorFlow) are built once. About 12 minutes here, 20 in one process.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# The long tests (marker `slow`; hours here, the fuzz soaks most of them), on two workers spread
# test by test (the 90 four-process trials of the local tier split between them). The 2.1 GiB
# tf.data state runs last in a process of its own: TensorFlow keeps ~9 GB until its process ends,
# beside which the kill trials ran out of this machine's 24 GiB. `-rfE` names what failed.
BIG_TF := tests/handlers/test_iterators.py::test_tf_state_over_two_gib
soak: install
	$(BIN)/python -m pytest -q -rfE -m slow -n 2 --dist load --deselect $(BIG_TF)
	$(BIN)/python -m pytest -q -rfE -m slow $(BIG_TF)

# The declared floors (.ci/lower_bounds.py reads them from pyproject.toml), each in a fresh venv
# under build/ (a plain editable install there leaves the strict editable tree alone). First the
# core, no extra, on NumPy 1.26: the tests that need nothing else (object stores need tensorstore,
# plots matplotlib, telemetry tensorboard, the CLI's Orbax hints orbax). Then every extra and dev
# tool at its floor, with the quick suite (two workers, as make test). `pip check` fails a floor
# that another package does not accept.
LOWER := build/venv-lower
LOWER_CORE_TESTS := tests/manager/test_policies.py tests/manager/test_policy_results.py \
	tests/manager/test_manager.py tests/manager/test_bad_input.py tests/manager/test_robustness.py \
	tests/manager/test_crash.py tests/manager/test_keep_items.py tests/contracts/test_storage_steps.py \
	tests/contracts/test_storage_crashes.py tests/contracts/test_storage_names.py \
	tests/contracts/test_storage_writer_hold.py tests/contracts/test_storage_shared_deletion.py \
	tests/handlers/test_destination.py tests/test_cli.py \
	-k "not s3 and not gcs and not memory and not bucket and not plot and not tensorboard \
	and not orbax_names and not orbax_advice"
lower-bounds:
	rm -rf $(LOWER)-core $(LOWER)
	$(PY) -m venv $(LOWER)-core
	$(LOWER)-core/bin/pip install --quiet 'tomli>=2; python_version < "3.11"'
	$(LOWER)-core/bin/python .ci/lower_bounds.py test > $(LOWER)-core/floors.txt
	$(LOWER)-core/bin/pip install --quiet -r $(LOWER)-core/floors.txt
	$(LOWER)-core/bin/pip install --quiet --no-deps -e .
	$(LOWER)-core/bin/pip check
	$(LOWER)-core/bin/python -m pytest -q -p no:cacheprovider $(LOWER_CORE_TESTS)
	$(PY) -m venv $(LOWER)
	$(LOWER)/bin/pip install --quiet 'tomli>=2; python_version < "3.11"'
	$(LOWER)/bin/python .ci/lower_bounds.py all dev > $(LOWER)/floors.txt
	$(LOWER)/bin/pip install --quiet -r $(LOWER)/floors.txt
	$(LOWER)/bin/pip install --quiet --no-deps -e .
	$(LOWER)/bin/pip check
	$(LOWER)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

demo: install
	$(BIN)/python examples/train_and_resume.py

# The train-state benchmark (cairn vs orbax-checkpoint vs memcpy and write+fsync, ~5 min here);
# bench/bench_save_restore.py is the older NumPy-leaf benchmark.
bench: install
	$(BIN)/python bench/bench_train_state.py

# What a background save costs the training loop, cairn against Orbax, on two train steps (~12 min).
bench-overhead: install
	$(BIN)/python bench/bench_overhead.py

# A job's first save (a new manager's, after restore()) against the steady state and Orbax (~5 min).
bench-first-save: install
	$(BIN)/python bench/bench_first_save.py

# A local tier beside S3 (moto), 2 jax.distributed processes, 1 GiB, local directories on this
# machine's disk, then on a RAM disk (/dev/shm): about 15-25 minutes each.
bench-multitier: install
	$(BIN)/python bench/bench_multitier.py
	$(BIN)/python bench/bench_multitier.py --ramdisk

bench-incremental: install
	$(BIN)/python bench/bench_incremental.py
	$(BIN)/python bench/bench_incremental.py --store s3 --size 256M

# Orbax's own checkpoint_manager_test.py against cairn.manager.orbax.CheckpointManager: pass counts
# per class of test (bench/orbax_suite; --against orbax for the baseline). About 2 minutes here.
orbax-suite: install
	$(BIN)/python bench/orbax_suite/run.py --against cairn --out bench/results/orbax_suite.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
