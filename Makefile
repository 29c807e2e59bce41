# Quick start: `make demo` (set up + run the demo), `make test` (set up + run the tests), `make check` (lint, types,
# import contract and unit tests: the fast loop for local work, under 2 minutes).
PYTHON ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip
STAMP = $(VENV)/.installed
DEMO_STAMP = $(VENV)/.installed-demo

.PHONY: demo test check lint setup bench-results clean

ADAPTERS = integrations/langchain-cpmemory integrations/mem0-cpmemory

$(STAMP): pyproject.toml $(ADAPTERS:%=%/pyproject.toml) benchmarks/pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch==2.13.0 is the CPU build (a local file on this machine kind); unpinned, pip takes a CUDA build.
	# The adapters and the research benchmarks (benchmarks/, unshipped) are distributions of their own (editable);
	# their `cpmemory` requirement is the editable root.
	$(PIP) install -q -e '.[all,dev]' -e 'integrations/langchain-cpmemory[langgraph,test]' \
		-e 'integrations/mem0-cpmemory[test]' -e benchmarks 'torch==2.13.0'
	$(PIP) install -q --no-deps 'contextpilot==0.5.0'
	touch $(STAMP)

setup: $(STAMP)

# The demo needs only the library and the command line (19 packages; no torch, no Mem0, no LangChain).
$(DEMO_STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[cli]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/cpmemory demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# ruff (rule set in pyproject.toml), the import contracts (layers, no cycles; ARCHITECTURE.md), mypy on cpmemory/ and
# benchmarks/cpmemory_benchmarks.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# lint + tests/unit (no Redis server, no child process, no real engine: tests/conftest.py refuses a test marked
# slow/redis/cluster/vllm there) + the contract suites on their in-process implementations (in-memory store, fakeredis,
# mock engine) + the research benchmarks' tests (benchmarks/tests); the real Redis, Redis Cluster and vLLM
# parameters carry the markers deselected here.
OFFLINE = not redis and not cluster and not vllm
check: lint
	$(VENV)/bin/python -m pytest -q -x -p no:cacheprovider -m "$(OFFLINE)" tests/unit tests/contract benchmarks/tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
