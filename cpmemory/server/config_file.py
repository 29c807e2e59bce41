"""Build a :class:`~cpmemory.server.config.ServerConfig` from a config file, command-line values and secrets.

Precedence, lowest first: the models' defaults, the file (``--config``: TOML, or YAML when PyYAML is installed),
the environment's secrets (``CPMEMORY_CACHE_SALT_SECRET``, ``CPMEMORY_API_KEYS`` as a JSON object, read with
pydantic-settings), then the flags given on the command line. The result is validated as one tree: an unknown key
anywhere is refused (every model forbids extras), and every cross-field rule is the model's own.

A file mirrors the tree (``docs/reference/serve.md`` names every key)::

    engines = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    redis_url = "redis://127.0.0.1:6379/0"

    [hold]
    policy = "pick"

    [fit]
    fill = 0.45
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib

from cpmemory.errors import InvalidInputError, MissingDependencyError
from cpmemory.server.config import ServerConfig

ENV_PREFIX = "CPMEMORY_"
"""The prefix of every environment variable the proxy reads."""


class ConfigFileError(InvalidInputError):
    """A config file that cannot be read or parsed."""


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file holds. Raises ConfigFileError when it cannot
    be read or parsed or is not a mapping, MissingDependencyError for YAML without PyYAML."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigFileError(f"cannot read {path}: {error}") from error
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as error:
            raise MissingDependencyError("server", "pyyaml", "pip install pyyaml") from error
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigFileError(f"{path} is not valid YAML: {error}") from error
    else:
        try:
            loaded = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigFileError(f"{path} is not valid TOML: {error}") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigFileError(f"{path} must hold a mapping of settings at its top level")
    return loaded


def environment_secrets() -> dict[str, Any]:
    """The secrets given in the environment (``CPMEMORY_CACHE_SALT_SECRET``, ``CPMEMORY_API_KEYS``), only those set.
    Read when called, never at import."""
    try:
        from pydantic_settings import BaseSettings, SettingsConfigDict
    except ImportError as error:  # pragma: no cover - the server extra installs it
        raise MissingDependencyError("server", "pydantic-settings") from error

    class Secrets(BaseSettings):
        model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

        cache_salt_secret: str | None = None
        api_keys: dict[str, str] | None = None

    return Secrets().model_dump(exclude_none=True)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s values over it, sections merged key by key (a new mapping; neither is changed)."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_config(file: Path | None = None, overrides: Mapping[str, Any] | None = None, *,
                 secrets: Mapping[str, Any] | None = None) -> ServerConfig:
    """The proxy's configuration: ``file``'s settings, then the environment's secrets (``secrets`` instead, when
    given), then ``overrides`` (the flags given; nested sections as mappings). Raises ConfigFileError for a file
    that cannot be read, pydantic's ValidationError for values the models refuse."""
    settings = read_config_file(file) if file is not None else {}
    settings = merge(settings, environment_secrets() if secrets is None else secrets)
    settings = merge(settings, overrides or {})
    return ServerConfig.model_validate(settings)
