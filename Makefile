# Two commands a newcomer needs: `make demo` and `make test`.
# Both create (or reuse) .venv and install the package with all three backends,
# pinned by constraints.txt. Only Python 3.10+ is needed beforehand.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet -c constraints.txt
BACKENDS := jax tensorflow torch
# `make demo BACKEND=torch` runs one backend; by default the demo runs all three.
BACKEND ?= $(BACKENDS)

# TensorFlow's C++ start-up logging buries the output a newcomer should read.
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-base: $(PY) pyproject.toml constraints.txt
	$(PIP) -e ".[all-cpu]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base
	$(PIP) -e ".[all-cpu,test]"
	touch $@

demo: $(VENV)/.installed-base
	@for b in $(BACKEND); do \
		echo "== KERAS_BACKEND=$$b"; \
		KERAS_BACKEND=$$b $(PY) examples/print_penalties.py || exit 1; \
	done

# The whole suite once per backend; fails if any backend fails.
test: $(VENV)/.installed-test
	@failed=""; \
	for b in $(BACKENDS); do \
		echo "== KERAS_BACKEND=$$b"; \
		KERAS_BACKEND=$$b $(PY) -m pytest || failed="$$failed $$b"; \
	done; \
	if [ -n "$$failed" ]; then echo "make test: failed on:$$failed"; exit 1; fi; \
	echo "make test: passed on $(BACKENDS)"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
