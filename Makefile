# Two commands on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test test-fast demo dataset bench clean

# The venv is (re)built when setup.py changes; otherwise this is a no-op.
$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Unit and socket tests only (no MXNet processes): a few seconds.
test-fast: setup
	$(PY) -m pytest tests/unit tests/integration $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/loopback.py

clean:
	rm -rf $(VENV) *.egg-info
