"""The benchmarks' own marker: ``realmodel`` tests need a real instruction-tuned model (scripts/real_model.sh)."""
from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "realmodel: needs a real model server (CPM_REAL_MODEL_URL); skipped when unset")
