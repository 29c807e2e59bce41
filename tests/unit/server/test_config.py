"""The proxy's configuration tree: gateway presets, the config file, secrets from the environment."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cpmemory.server.config import ServerConfig
from cpmemory.server.config_file import ConfigFileError, build_config, environment_secrets, merge


def test_a_gateway_kind_sets_its_preset_and_given_fields_override_it() -> None:
    router = ServerConfig(upstream="http://gw", upstream_kind="vllm-router")
    assert router.upstream_session and not router.cache_salt  # named sessions; no salt for its kv_aware routing
    tenants = ServerConfig(upstream="http://gw", upstream_kind="vllm-router", api_keys={"k": "t"},
                           cache_salt_secret="s" * 16)
    assert tenants.cache_salt  # salts keep tenants apart: the preset never turns them off with API keys
    sglang = ServerConfig(upstream="http://gw", upstream_kind="sglang")
    assert not sglang.upstream_session and sglang.cache_salt  # SGLang gives session_params its own meaning
    given = ServerConfig(upstream="http://gw", upstream_kind="vllm-router", cache_salt=True)
    assert given.cache_salt and given.upstream_session
    with pytest.raises(ValidationError, match="needs an upstream"):
        ServerConfig(engines=["http://e"], upstream_kind="llm-d")
    with pytest.raises(ValidationError):
        ServerConfig(upstream="http://gw", upstream_kind="nginx")


def test_the_file_is_validated_as_one_tree_and_flags_override_it(tmp_path: Path) -> None:
    settings = tmp_path / "serve.toml"
    settings.write_text('engines = ["http://a", "http://b"]\n[hold]\npolicy = "window"\ntimeout_ms = 250\n'
                        '[experimental]\nfit_move = false\n')
    config = build_config(settings, {"hold": {"policy": "pick"}}, secrets={})
    assert config.engines == ["http://a", "http://b"] and config.hold.policy == "pick"
    assert config.hold.timeout_ms == 250 and not config.experimental.fit_move
    settings.write_text('engines = ["http://a"]\n[hold]\npolcy = "window"\n')
    with pytest.raises(ValidationError, match="polcy"):  # an unknown key is refused, not ignored
        build_config(settings, secrets={})
    settings.write_text("engines = [")
    with pytest.raises(ConfigFileError):
        build_config(settings, secrets={})


def test_a_yaml_file_reads_the_same_tree(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    settings = tmp_path / "serve.yaml"
    settings.write_text("engines: [http://a]\nfit:\n  fill: 0.5\n")
    assert build_config(settings, secrets={}).fit.fill == 0.5


def test_secrets_come_from_the_environment_with_the_one_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPMEMORY_CACHE_SALT_SECRET", "x" * 20)
    monkeypatch.setenv("CPMEMORY_API_KEYS", '{"key-1": "alice"}')
    assert environment_secrets() == {"cache_salt_secret": "x" * 20, "api_keys": {"key-1": "alice"}}
    config = build_config(None, {"engines": ["http://a"]})
    assert config.api_keys == {"key-1": "alice"} and config.cache_salt_secret.get_secret_value() == "x" * 20


def test_merge_keeps_sections_key_by_key() -> None:
    base = {"fit": {"fill": 0.5, "idle_ms": 9.0}, "engines": ["a"]}
    assert merge(base, {"fit": {"fill": 0.7}}) == {"fit": {"fill": 0.7, "idle_ms": 9.0}, "engines": ["a"]}
    assert base["fit"]["fill"] == 0.5  # neither input changes
