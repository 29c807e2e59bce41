"""Session store URLs: ``redis+cluster://`` names a cluster, bad schemes and cluster databases are typed errors."""
from __future__ import annotations

import pytest

from cpmemory.errors import InvalidInputError
from cpmemory.server.store_setup import StoreUrl, parse_store_url, redacted


def test_cluster_urls_become_redis_urls_with_the_cluster_flag() -> None:
    assert parse_store_url("redis://h:1/2") == StoreUrl("redis://h:1/2", cluster=False)
    assert parse_store_url("redis+cluster://h:7000") == StoreUrl("redis://h:7000", cluster=True)
    assert parse_store_url("rediss+cluster://u:p@h:7000/0?ssl_cert_reqs=none") == StoreUrl(
        "rediss://u:p@h:7000?ssl_cert_reqs=none", cluster=True)
    assert parse_store_url("unix:///tmp/redis.sock").cluster is False


@pytest.mark.parametrize("url", ["memcached://h:1", "redis+cluster://h:7000/3", "h:6379"])
def test_unknown_schemes_and_cluster_databases_are_refused(url: str) -> None:
    with pytest.raises(InvalidInputError):
        parse_store_url(url)


def test_passwords_are_hidden_in_what_is_printed() -> None:
    assert redacted("redis://:secret@h:1/0") == "redis://:***@h:1/0"
    assert redacted("redis+cluster://user:secret@h:7000") == "redis+cluster://user:***@h:7000"
    assert redacted("redis://h:1/0") == "redis://h:1/0"


def test_the_start_line_names_address_engines_store_and_policies_without_the_password() -> None:
    from cpmemory.server.config import ServerConfig
    from cpmemory.server.launch import start_line

    line = start_line(ServerConfig(engines=["http://e0:8000", "http://e1:8000"],
                                   redis_url="redis+cluster://:hunter2hunter2@r:7000"), "0.0.0.0", 9000)
    assert line.startswith("cpmemory proxy listening on http://0.0.0.0:9000")
    assert "engines http://e0:8000, http://e1:8000" in line and "Redis Cluster redis+cluster://:***@r:7000" in line
    assert "hunter2" not in line and "router prefix" in line and "\n" not in line
