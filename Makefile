# Quick start: `make demo` (set up + run the demo), `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip
STAMP = $(VENV)/.installed

.PHONY: demo test setup bench-results clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[all,dev]'
	$(PIP) install -q --no-deps 'contextpilot==0.5.0'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/cpmemory demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
