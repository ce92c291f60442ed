# Two commands a newcomer needs: `make demo` and `make test`.
# Both create (or reuse) .venv and install the package with all three backends,
# pinned by constraints.txt. Only Python 3.10+ is needed beforehand.

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

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-base: $(PY) pyproject.toml constraints.txt
	$(PIP) -e ".[all-cpu,demo]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base
	$(PIP) -e ".[all-cpu,test]"
	touch $@

# Trains a small classifier with composed penalties and PenaltyMonitor, prints
# the per-term table and writes demo_output/penalty_monitor_<backend>.png.
demo: $(VENV)/.installed-base
	@mkdir -p demo_output
	KERAS_BACKEND=$(or $(BACKEND),jax) PENALTY_MONITOR_PNG=demo_output/penalty_monitor_$(or $(BACKEND),jax).png \
		$(PY) examples/penalty_monitor.py

# The whole suite once per backend; fails if any backend fails.
test: $(VENV)/.installed-test
	@failed=""; \
	for b in $(BACKENDS); do \
		echo "== KERAS_BACKEND=$$b"; \
		KERAS_BACKEND=$$b $(PY) -m pytest || failed="$$failed $$b"; \
	done; \
	if [ -n "$$failed" ]; then echo "make test: failed on:$$failed"; exit 1; fi; \
	echo "make test: passed on $(BACKENDS)"

# Benchmarks (not tests): `make bench`, or `make bench BACKEND=jax` for one backend.
# Writes bench/results/<backend>.json and .md.
$(VENV)/.installed-bench: $(VENV)/.installed-base
	$(PIP) -e ".[all-cpu,bench]"
	touch $@

bench: $(VENV)/.installed-bench
	@for b in $(or $(BACKEND),$(BACKENDS)); do \
		echo "== KERAS_BACKEND=$$b"; \
		KERAS_BACKEND=$$b $(PY) -m bench.run || exit 1; \
	done; \
	$(PY) -m bench.summary --readme

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
