"""Validated configuration of the Redis connector.

A ``url`` (``redis://``, ``rediss://``, ``unix://``, ``sentinel://``) is
parsed into the individual fields at validation time, so the rest of the
plugin only reads fields. The password never appears in ``repr``, in the
stored ``url`` or in any error message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from omni_plugins.importing import import_string
from omni_plugins.settings import ConnectorSettings

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

# Redis refuses values above 512 MB; parts stay far below that.
MIN_CHUNK_BYTES = 64 * KIB
MAX_CHUNK_BYTES = 256 * MIB

_URL_SCHEMES = ("redis", "rediss", "unix", "sentinel")
SENTINEL_PORT = 26379


class RedisConfig(ConnectorSettings):
    """Connection, namespace, chunking and retry settings for ``RedisConnector``."""

    url: str | None = Field(
        None,
        description="redis://[user[:pass]@]host[:port][/db], rediss://..., unix:///path?db=N, "
        "sentinel://[user[:pass]@]host:port[,host:port...]/service_name[/db]",
    )
    host: str = Field("127.0.0.1", description="server host when no url is given")
    port: int = Field(6379, ge=1, le=65535, description="server port when no url is given")
    db: int = Field(0, ge=0, le=1_000_000, description="database number when no url is given")
    unix_socket: str | None = Field(None, description="path of the server's unix socket (instead of host/port)")
    username: str | None = Field(None, description="ACL user (Redis 6+); None means 'default'")
    password: SecretStr | None = Field(None, description="password (of username, or of the default user); never in repr, logs or errors")
    credential_provider: str | None = Field(
        None,
        description="'package.module:name' of a redis-py CredentialProvider (instance, class or zero-argument factory) "
        "that supplies username and password at every connect (rotating secrets, cloud IAM tokens); "
        "instead of username/password",
    )

    tls: bool = Field(False, description="connect with TLS (a rediss:// url sets it)")
    tls_ca_file: Path | None = Field(None, description="CA certificate file to verify the server with (must exist)")
    tls_cert_file: Path | None = Field(None, description="client certificate file, for tls-auth-clients (with tls_key_file)")
    tls_key_file: Path | None = Field(None, description="private key of tls_cert_file")
    tls_check_hostname: bool = Field(True, description="check that the server certificate names the host")

    cluster: bool = Field(False, description="talk to a Redis Cluster; startup_nodes (or host:port) seed the slot map")
    startup_nodes: list[str] = Field(default_factory=list, description="'host:port' entries of cluster nodes")

    sentinels: list[str] = Field(
        default_factory=list, description="'host:port' entries of Redis Sentinels; the connector follows service_name's primary"
    )
    service_name: str | None = Field(None, description="the primary's name the Sentinels monitor (sentinel monitor <name> ...)")
    sentinel_username: str | None = Field(None, description="ACL user on the Sentinels themselves (if they require one)")
    sentinel_password: SecretStr | None = Field(None, description="password of the Sentinels themselves (sentinel requirepass)")

    min_replica_acks: int = Field(
        0,
        ge=0,
        le=64,
        description="a put returns ok only once this many replicas confirmed it (WAIT); one that falls short fails and is "
        "withdrawn. A failover keeps it only if it promotes one of them: set the number of replicas. "
        "0 = the primary's acknowledgement (a failover may lose the last writes)",
    )
    replica_ack_timeout: float = Field(1.0, gt=0, le=3600, description="how long a put waits for min_replica_acks replicas (below socket_timeout)")
    protocol: Literal[2, 3] = Field(2, description="RESP version (3 needs '+hello' for an ACL user)")

    key_prefix: str = Field("omni:", max_length=200, description="namespace of every key this connector writes")
    ttl_seconds: float = Field(300.0, ge=0, le=365 * 86400, description="expiry of unread payloads; 0 = never expire")
    # 2 MiB parts cost the server less CPU per byte than 1 or 4 MiB (smaller reply buffers and query-buffer
    # moves in Redis); omni-plugins bench --backends redis --config redis='{"chunk_bytes": N}' measures other sizes
    chunk_bytes: int = Field(2 * MIB, ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES, description="size of one stored part")
    inline_bytes: int = Field(
        256 * KIB, ge=0, le=MAX_CHUNK_BYTES, description="payloads up to this size (capped at chunk_bytes) travel in the manifest itself"
    )
    read_window: int = Field(2, ge=1, le=64, description="part reads kept in flight on one connection")
    max_payload_bytes: int = Field(64 * GIB, ge=1, description="largest payload a manifest may announce (manifests are untrusted)")

    lazy_cleanup: bool = Field(
        True,
        description="send small cleanup commands (commit marker, claim list) with the next write on the same connection "
        "instead of at once: saves a system call per put/get; off = no key outlives its operation, at one extra send",
    )

    reuse_part_memory: bool = Field(
        True,
        description="with lazy_cleanup: a get leaves the consumed payload's (unreachable) parts for the next parted put "
        "on the same connection to delete one by one, so the server reuses their memory instead of faulting in fresh "
        "pages; any other write deletes them at once. off = parts are deleted right after the get",
    )

    connect_timeout: float = Field(5.0, gt=0, le=3600, description="bound on every connect, in seconds")
    socket_timeout: float = Field(30.0, gt=0, le=3600, description="bound on every socket read/write; nothing waits forever")
    pool_size: int = Field(16, ge=1, le=1024, description="connections per server")
    pool_timeout: float = Field(30.0, gt=0, le=3600, description="wait for a free pooled connection")
    retry_attempts: int = Field(6, ge=0, le=1000, description="retries after a connection failure")
    retry_backoff: float = Field(0.05, gt=0, le=60, description="first retry delay; doubles each attempt")
    retry_backoff_max: float = Field(2.0, gt=0, le=600, description="longest retry delay")
    poll_interval_max: float = Field(0.05, gt=0, le=10, description="longest sleep of the polling fallback of get(timeout=)")

    @model_validator(mode="before")
    @classmethod
    def _parse_url(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("url"):
            return data
        data = dict(data)
        parsed = _parse_redis_url(str(data["url"]))
        for name, value in parsed.items():
            if name == "url":
                continue
            given = data.get(name)
            if given is not None and name in data:
                if isinstance(given, SecretStr):
                    given = given.get_secret_value()
                if given != value:
                    raise ValueError(f"{name} is given both in url and as a field, with different values")
            data[name] = value
        data["url"] = parsed["url"]
        return data

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if "{" in value or "}" in value:
            raise ValueError("key_prefix must not contain '{' or '}' (they delimit Redis Cluster hash tags)")
        if any(ch.isspace() or not ch.isprintable() for ch in value):
            raise ValueError("key_prefix must be printable and contain no whitespace")
        return value

    @field_validator("startup_nodes", "sentinels")
    @classmethod
    def _check_nodes(cls, value: list[str]) -> list[str]:
        for node in value:
            _split_host_port(node)
        return value

    @field_validator("credential_provider")
    @classmethod
    def _check_provider(cls, value: str | None) -> str | None:
        if value is not None:
            load_credential_provider(value)
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> RedisConfig:
        if self.cluster and self.unix_socket:
            raise ValueError("cluster mode needs TCP nodes, not a unix socket")
        if bool(self.sentinels) != bool(self.service_name):
            raise ValueError("sentinels and service_name go together")
        if self.sentinels and (self.cluster or self.unix_socket):
            raise ValueError("Sentinel mode excludes cluster and unix_socket")
        if self.credential_provider and (self.username or self.password is not None):
            raise ValueError("credential_provider replaces username/password: give one or the other")
        if self.cluster and self.db != 0:
            raise ValueError("Redis Cluster only has db 0")
        if self.min_replica_acks and self.replica_ack_timeout >= self.socket_timeout:
            raise ValueError("replica_ack_timeout must be below socket_timeout (the WAIT reply is a socket read)")
        if self.unix_socket and self.tls:
            raise ValueError("TLS over a unix socket is not supported")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        tls_files = {"tls_ca_file": self.tls_ca_file, "tls_cert_file": self.tls_cert_file, "tls_key_file": self.tls_key_file}
        for name, path in tls_files.items():
            if path is None:
                continue
            if not self.tls:
                raise ValueError(f"{name} is set but tls is off (use rediss:// or tls: true)")
            if not path.is_file():
                raise ValueError(f"{name}: no such file {str(path)!r}")
        return self

    # -- derived values ----------------------------------------------------
    def nodes(self) -> list[tuple[str, int]]:
        """TCP (host, port) seeds: the startup nodes in cluster mode, else host:port."""
        if self.cluster and self.startup_nodes:
            return [_split_host_port(node) for node in self.startup_nodes]
        return [(self.host, self.port)]

    def sentinel_nodes(self) -> list[tuple[str, int]]:
        return [_split_host_port(node) for node in self.sentinels]

    def server_label(self) -> str:
        """Where the connector talks to, for logs and errors (never contains the password)."""
        if self.sentinels:
            tls = "+tls" if self.tls else ""
            return f"sentinel{tls}://" + ",".join(self.sentinels) + f"/{self.service_name}/{self.db}"
        if self.unix_socket:
            return f"unix://{self.unix_socket}?db={self.db}"
        scheme = "rediss" if self.tls else "redis"
        if self.cluster:
            return f"{scheme}+cluster://" + ",".join(f"{h}:{p}" for h, p in self.nodes())
        return f"{scheme}://{self.host}:{self.port}/{self.db}"


def load_credential_provider(path: str) -> Any:
    """The redis-py credential provider ``path`` names (an instance, a class or a zero-argument factory)."""
    try:
        found = import_string(path)
    except ImportError as exc:
        raise ValueError(f"credential_provider: {exc}") from None
    provider = found() if callable(found) and not hasattr(found, "get_credentials") else found
    if isinstance(provider, type):
        provider = provider()
    if not callable(getattr(provider, "get_credentials", None)):
        raise ValueError(f"credential_provider {path!r} is not a redis-py CredentialProvider (no get_credentials())")
    return provider


def _split_host_port(node: str) -> tuple[str, int]:
    host, sep, port = node.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"node {node!r} is not 'host:port'")
    return host.strip("[]"), int(port)


def _parse_sentinel_url(url: str) -> dict[str, Any]:
    """``sentinel://[user[:pass]@]host[:port][,host[:port]...]/service_name[/db]`` (several hosts: urlsplit cannot)."""
    rest = url[len("sentinel://") :]
    netloc, _, path = rest.partition("/")
    path, _, query_text = path.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    out: dict[str, Any] = {}
    if at:
        user, colon, secret = userinfo.partition(":")
        if user:
            out["username"] = unquote(user)
        if colon:
            out["password"] = unquote(secret)
    if not hosts:
        raise ValueError("sentinel:// url needs at least one sentinel host")
    nodes = [f"{h}:{SENTINEL_PORT}" if ":" not in h or h.endswith("]") else h for h in hosts.split(",")]
    for node in nodes:
        _split_host_port(node)
    out["sentinels"] = nodes
    segments = [unquote(s) for s in path.split("/") if s]
    if not segments or len(segments) > 2:
        raise ValueError("sentinel:// url path must be /service_name or /service_name/db")
    out["service_name"] = segments[0]
    db_text = segments[1] if len(segments) == 2 else parse_qs(query_text).get("db", [None])[0]
    if db_text is not None:
        if not db_text.isdigit():
            raise ValueError(f"url database must be a number, not {db_text!r}")
        out["db"] = int(db_text)
    user = f"{userinfo.partition(':')[0]}@" if at and userinfo.partition(":")[0] else ""
    out["url"] = f"sentinel://{user}{hosts}/{path}" + (f"?{query_text}" if query_text else "")
    return out


def _parse_redis_url(url: str) -> dict[str, Any]:
    """Split a Redis URL into config fields; the returned ``url`` has the password removed."""
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in _URL_SCHEMES:
        raise ValueError(f"url scheme must be one of {', '.join(s + '://' for s in _URL_SCHEMES)}, not {scheme!r}")
    if scheme == "sentinel":
        return _parse_sentinel_url(url)
    parts = urlsplit(url)
    out: dict[str, Any] = {}
    if parts.username:
        out["username"] = unquote(parts.username)
    if parts.password is not None:
        out["password"] = unquote(parts.password)
    query = parse_qs(parts.query)
    db_text: str | None = None
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("unix:// url needs a socket path, e.g. unix:///run/redis.sock")
        out["unix_socket"] = unquote(parts.path)
        db_text = query.get("db", [None])[0]
    else:
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"url has an invalid port: {exc}") from None
        if parts.hostname:
            out["host"] = parts.hostname
        if port is not None:
            out["port"] = port
        path = parts.path.lstrip("/")
        db_text = path or query.get("db", [None])[0]
        if parts.scheme == "rediss":
            out["tls"] = True
    if db_text is not None:
        if not db_text.isdigit():
            raise ValueError(f"url database must be a number, not {db_text!r}")
        out["db"] = int(db_text)
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    if parts.username:
        netloc = f"{parts.username}@{netloc}"
    out["url"] = parts._replace(netloc=netloc).geturl()
    return out
