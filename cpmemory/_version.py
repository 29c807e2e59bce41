"""The one source of the package version (pyproject.toml reads it; the proxy reports it)."""

__version__ = "0.1.0"
