"""The generated configuration reference (docs/reference/serve.md) matches the config models."""
from __future__ import annotations

from pathlib import Path

from cpmemory.server.config import ServerConfig
from cpmemory.server.reference import render

ROOT = Path(__file__).resolve().parents[3]


def test_the_committed_reference_is_current() -> None:
    committed = (ROOT / "docs" / "reference" / "serve.md").read_text(encoding="utf-8")
    assert committed == render(), "stale: run python -m cpmemory.server.reference"


def test_every_field_of_the_tree_is_in_the_reference() -> None:
    page = render()
    for name in ServerConfig.model_fields:
        assert f"| `{name}` |" in page
    for section in ("hold", "fit", "experimental", "router"):
        for name in ServerConfig.model_fields[section].default_factory().model_fields:  # type: ignore[misc]
            assert f"| `{section}.{name}` |" in page
