"""Passwords, least-privilege ACL users, TLS-only servers and unix sockets."""

from __future__ import annotations

import logging
import stat
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from omni_plugins_redis.connector import ACL_COMMANDS, acl_rule
from omni_plugins_redis.testing import RedisServer

from omni_plugins import create_connector
from omni_plugins.errors import ConnectorError

PREFIX = "omnitest:"
ADMIN_PW = "admin-Secret-1"
APP_PW = "app-Secret-2"


def _roundtrip(config: dict[str, Any], key: str = "k") -> None:
    big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: several parts with chunk_bytes=256 KiB
    with create_connector("redis", {**config, "chunk_bytes": 256 * 1024}) as conn:
        assert conn.put(0, 1, key + "-small", {"v": torch.ones(4)}).ok
        assert conn.put(0, 1, key + "-big", {"v": big}).ok
        small = conn.get(0, 1, key + "-small", timeout=5)
        got = conn.get(0, 1, key + "-big", timeout=5)
        assert small is not None and torch.equal(small.data["v"], torch.ones(4))
        assert got is not None and torch.equal(got.data["v"], big)
        assert conn.put(0, 1, key + "-gone", {"v": big}).ok
        assert conn.cleanup(key + "-gone") is True
        assert conn.get(0, 1, key + "-gone") is None


@pytest.fixture(scope="module")
def acl_server(track_server: Any) -> Iterator[RedisServer]:
    users = [
        f"app on >{APP_PW} {acl_rule(PREFIX)}",
        f"noblock on >{APP_PW} {acl_rule(PREFIX, commands=tuple(c for c in ACL_COMMANDS if c != 'blmove'))}",
    ]
    with RedisServer(password=ADMIN_PW, acl_users=users) as server:
        track_server(server)
        yield server
        assert server.keys(PREFIX + "*") == []


def test_wrong_password_fails_clearly(acl_server: RedisServer) -> None:
    config = {"url": acl_server.url, "username": "app", "password": "wrong-pw-123", "key_prefix": PREFIX, "retry_attempts": 1}
    with create_connector("redis", config) as conn, pytest.raises(ConnectorError) as info:
        conn.put(0, 1, "k", {"v": 1})
    message = str(info.value)
    assert "rejected user 'app'" in message and "127.0.0.1" in message
    assert "wrong-pw-123" not in message
    with create_connector("redis", config) as conn:
        status = conn.health()
        assert status["ok"] is False and "wrong-pw-123" not in str(status)


def test_no_password_against_protected_server(acl_server: RedisServer) -> None:
    config = {"url": acl_server.url, "key_prefix": PREFIX, "retry_attempts": 1}
    with create_connector("redis", config) as conn, pytest.raises(ConnectorError, match="NOAUTH"):
        conn.get(0, 1, "k")


def test_least_privilege_user_works(acl_server: RedisServer) -> None:
    _roundtrip({"url": acl_server.url, "username": "app", "password": APP_PW, "key_prefix": PREFIX})


def test_user_outside_its_key_pattern_gets_a_clear_error(acl_server: RedisServer) -> None:
    config = {"url": acl_server.url, "username": "app", "password": APP_PW, "key_prefix": "elsewhere:"}
    with create_connector("redis", config) as conn, pytest.raises(ConnectorError) as info:
        conn.put(0, 1, "k", {"v": 1})
    assert "NOPERM" in str(info.value) and "'k'" in str(info.value)
    assert acl_server.keys("elsewhere:*") == []


def test_without_blmove_get_waits_by_polling_and_says_so_once(acl_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    config = {"url": acl_server.url, "username": "noblock", "password": APP_PW, "key_prefix": PREFIX}
    with create_connector("redis", config) as conn, create_connector("redis", config) as producer:
        with caplog.at_level(logging.WARNING, logger="omni_plugins_redis"):
            assert conn.get(0, 1, "late", timeout=0.2) is None
            assert conn.get(0, 1, "late", timeout=0.2) is None
        warnings = [r for r in caplog.records if "BLMOVE" in r.getMessage()]
        assert len(warnings) == 1
        assert conn.health()["blocking_get"] is False
        import threading

        timer = threading.Timer(0.3, lambda: producer.put(0, 1, "late", {"v": torch.arange(3)}))
        timer.start()
        got = conn.get(0, 1, "late", timeout=10)
        timer.join()
        assert got is not None and torch.equal(got.data["v"], torch.arange(3))


def test_tls_only_server(track_server: Any) -> None:
    with RedisServer(tls=True, password=ADMIN_PW) as server:
        track_server(server)
        config = server.connector_config(key_prefix=PREFIX)
        assert config["url"].startswith("rediss://")
        _roundtrip(config)
        plain = {**config, "url": config["url"].replace("rediss://", "redis://"), "retry_attempts": 1, "socket_timeout": 2}
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            plain.pop(name)
        with create_connector("redis", plain) as conn, pytest.raises(ConnectorError):
            conn.get(0, 1, "k")
        untrusted = {**config, "tls_ca_file": None, "retry_attempts": 0}
        with create_connector("redis", untrusted) as conn, pytest.raises(ConnectorError, match="CERTIFICATE_VERIFY_FAILED"):
            conn.get(0, 1, "k")
        assert server.keys("*") == []


def test_unix_socket_server(track_server: Any) -> None:
    with RedisServer(unix_socket=True) as server:
        track_server(server)
        assert server.socket_path is not None
        assert stat.S_IMODE(server.socket_path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(server.socket_path.stat().st_mode) == 0o700
        config = server.connector_config(key_prefix=PREFIX)
        assert config["url"].startswith("unix://")
        _roundtrip(config)
        assert server.keys("*") == []


def test_tls_cluster_with_password(track_server: Any) -> None:
    from omni_plugins_redis.testing import RedisCluster

    with RedisCluster(masters=3, tls=True, password=ADMIN_PW) as cluster:
        track_server(cluster)
        config = cluster.connector_config(key_prefix=PREFIX)
        assert config["tls"] is True
        _roundtrip(config)
        with create_connector("redis", config) as conn:
            assert conn.health()["nodes"] == 3
        assert cluster.keys(PREFIX + "*") == []


class AppCredentials:
    """A redis-py credential provider (what a rotating-secret or cloud-IAM provider implements)."""

    calls = 0

    def get_credentials(self) -> tuple[str, str]:
        AppCredentials.calls += 1
        return ("app", APP_PW)


class WrongCredentials:
    def get_credentials(self) -> tuple[str, str]:
        return ("app", "not-the-password-9")


def test_credential_provider_supplies_user_and_password(acl_server: RedisServer) -> None:
    AppCredentials.calls = 0
    _roundtrip({"url": acl_server.url, "credential_provider": f"{__name__}:AppCredentials", "key_prefix": PREFIX})
    assert AppCredentials.calls >= 1, "the provider was not asked"
    config = {"url": acl_server.url, "credential_provider": f"{__name__}:WrongCredentials", "key_prefix": PREFIX, "retry_attempts": 1}
    with create_connector("redis", config) as conn, pytest.raises(ConnectorError) as info:
        conn.put(0, 1, "k", {"v": 1})
    assert "rejected the user of credential_provider" in str(info.value) and "not-the-password-9" not in str(info.value)


def test_resp3(acl_server: RedisServer) -> None:
    """``protocol: 3`` (HELLO 3): the same puts and gets, parts read into the payload buffer alike."""
    _roundtrip({"url": acl_server.url, "password": ADMIN_PW, "key_prefix": PREFIX, "protocol": 3})
