# Quick start: `make demo` (set up + run the demo), `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip
STAMP = $(VENV)/.installed

.PHONY: demo test setup bench-results clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch==2.13.0 is the CPU build (a local file on this machine kind); unpinned, pip takes a CUDA build.
	$(PIP) install -q -e '.[all,dev]' 'torch==2.13.0'
	$(PIP) install -q --no-deps 'contextpilot==0.5.0'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/cpmemory demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
