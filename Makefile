# Two commands a newcomer needs: `make demo` and `make test`.
# Both create (or reuse) .venv and install the package, pinned by
# constraints.txt: the demo only its backend's framework (JAX by default,
# `make demo BACKEND=torch`), the tests all three. Only Python 3.10+ is
# needed beforehand.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet -c constraints.txt
BACKENDS := jax tensorflow torch
# `make demo BACKEND=torch` picks the demo's backend (JAX by default);
# `make bench BACKEND=jax` benchmarks one backend (all three by default).
BACKEND ?=

# TensorFlow's C++ start-up logging buries the output a newcomer should read.
export TF_CPP_MIN_LOG_LEVEL ?= 2
# mkdocs-material prints a boxed notice about MkDocs 2 on every build.
export NO_MKDOCS_2_WARNING ?= 1

.PHONY: demo test bench docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)

DEMO_BACKEND := $(or $(BACKEND),jax)
# The extra that installs each backend's framework (TensorFlow: the CPU build).
EXTRA_jax := jax
EXTRA_tensorflow := tensorflow-cpu
EXTRA_torch := torch

$(VENV)/.installed-demo-%: $(PY) pyproject.toml constraints.txt
	@test -n "$(EXTRA_$*)" || { echo "BACKEND must be one of: $(BACKENDS)"; exit 1; }
	$(PIP) -e ".[$(EXTRA_$*),demo]"
	touch $@

# keras-hub without its requirements (they pull a second TensorFlow), with the
# two packages it imports; it needs Python 3.11+ (older ones skip its tests).
KERAS_HUB := "keras-hub; python_version >= '3.11'" "regex; python_version >= '3.11'" "tokenizers; python_version >= '3.11'"

# The oldest Keras pyproject.toml admits (keras>=3.14), beside the pinned one:
# its wheel alone in a folder put first on PYTHONPATH (its requirements are
# the pinned Keras's). The integration tests run on it too.
KERAS_OLDEST := 3.14.1
KERAS_OLDEST_PATH := $(VENV)/keras-$(KERAS_OLDEST)
# Those that lean on Keras' internals: composition, adaptive weighting, the
# monitor, save/load, and training settings (mixed precision, shared layers).
INTEGRATION_TESTS := tests/test_objective.py tests/test_composite_loss.py tests/test_weighting.py \
	tests/test_monitor.py tests/test_saving.py tests/test_training_settings.py

$(VENV)/.installed-test: $(PY) pyproject.toml constraints.txt
	$(PIP) -e ".[all-cpu,test,docs]"
	$(PIP) --no-deps $(KERAS_HUB)
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(KERAS_OLDEST_PATH) keras==$(KERAS_OLDEST)
	touch $@

# Trains a small classifier with composed penalties and PenaltyMonitor, prints
# the per-term table and writes demo_output/penalty_monitor_<backend>.png.
demo: $(VENV)/.installed-demo-$(DEMO_BACKEND)
	@mkdir -p demo_output
	KERAS_BACKEND=$(DEMO_BACKEND) PENALTY_MONITOR_PNG=demo_output/penalty_monitor_$(DEMO_BACKEND).png \
		$(PY) examples/penalty_monitor.py

# Test processes per backend (pytest-xdist; 0: one process). Most of a JAX
# test is one-core compilation: on these 2-core machines 2 processes took
# the JAX suite from 17.2 to 12.0 min (make test took 33-38 min in one
# process, 35 allowed). Torch's suite, short ops on 2 threads each, took
# 2:17 in one process and 2:54 in two.
TEST_WORKERS_jax ?= 2
TEST_WORKERS_tensorflow ?= 2
TEST_WORKERS_torch ?= 0

# The whole suite once per backend, the integration tests once per backend
# on the oldest Keras, the type check (mypy on keras_penalties/, configured
# in pyproject.toml: 2 s), the lint and format check (ruff, [tool.ruff]), then the package as PyPI would get it (sdist and
# wheel, `twine check --strict`), then the documentation site (`mkdocs build
# --strict`: a broken link, anchor or docstring fails it); fails if any of
# them fails.
test: $(VENV)/.installed-test
	@failed=""; \
	workers_jax=$(TEST_WORKERS_jax); workers_tensorflow=$(TEST_WORKERS_tensorflow); workers_torch=$(TEST_WORKERS_torch); \
	for b in $(BACKENDS); do \
		echo "== KERAS_BACKEND=$$b"; eval n=\$$workers_$$b; \
		KERAS_BACKEND=$$b $(PY) -m pytest -n $$n || failed="$$failed $$b"; \
	done; \
	for b in $(BACKENDS); do \
		echo "== KERAS_BACKEND=$$b, keras $(KERAS_OLDEST): integration tests"; eval n=\$$workers_$$b; \
		PYTHONPATH=$(KERAS_OLDEST_PATH) KERAS_BACKEND=$$b $(PY) -m pytest -n $$n $(INTEGRATION_TESTS) \
			|| failed="$$failed $$b-keras-$(KERAS_OLDEST)"; \
	done; \
	echo "== types: mypy"; \
	$(PY) -m mypy || failed="$$failed types"; \
	echo "== lint: ruff check, ruff format --check"; \
	{ $(PY) -m ruff check keras_penalties tests bench && $(PY) -m ruff format --check keras_penalties tests bench; } \
		|| failed="$$failed lint"; \
	echo "== package: build, twine check"; \
	dist=$$(mktemp -d); \
	{ $(PY) -m build --no-isolation --outdir $$dist . > $$dist/build.log 2>&1 \
		&& $(PY) -m twine check --strict $$dist/*.whl $$dist/*.tar.gz; } \
		|| { cat $$dist/build.log; failed="$$failed package"; }; \
	rm -rf $$dist; \
	echo "== docs: mkdocs build --strict"; \
	if $(DOCS_PYTHON); then \
		site=$$(mktemp -d); \
		$(PY) -m mkdocs build --strict --quiet --site-dir $$site/site > $$site/docs.log 2>&1 \
			|| { cat $$site/docs.log; failed="$$failed docs"; }; \
		rm -rf $$site; \
	else echo "skipped: the docs extra needs Python 3.11+"; fi; \
	if [ -n "$$failed" ]; then echo "make test: failed on:$$failed"; exit 1; fi; \
	echo "make test: passed on $(BACKENDS), the type check, the package check and the docs build"

# Benchmarks (not tests): `make bench`, or `make bench BACKEND=jax` for one backend.
# Writes bench/results/<backend>.json and .md.
$(VENV)/.installed-bench: $(PY) pyproject.toml constraints.txt
	$(PIP) -e ".[all-cpu,bench]"
	touch $@

bench: $(VENV)/.installed-bench
	@for b in $(or $(BACKEND),$(BACKENDS)); do \
		echo "== KERAS_BACKEND=$$b"; \
		KERAS_BACKEND=$$b $(PY) -m bench.run || exit 1; \
	done; \
	$(PY) -m bench.summary --page

# The documentation site (mkdocs.yml, docs/, the guides rendered by
# docs/hooks.py): `make docs` builds it into site/ with --strict, so a broken
# reference or link fails; `.venv/bin/mkdocs serve` previews it while editing.
# Its packages (the docs extra) need Python 3.11+.
DOCS_PYTHON := $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))'

$(VENV)/.installed-docs: $(PY) pyproject.toml constraints.txt
	@$(DOCS_PYTHON) || { echo "make docs needs Python 3.11+ in $(VENV) (make clean; make docs PYTHON=python3.11)"; exit 1; }
	$(PIP) -e ".[docs]"
	touch $@

docs: $(VENV)/.installed-docs
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis .mypy_cache site
