"""Config models of the two Mooncake connectors (validated from a stage's ``extra`` mapping).

Field names are this project's; the short names used by vllm-omni's Mooncake
connector (``host``, ``master``, ``segment``, ``localbuf``, ``proto``,
``rdma``) are accepted as aliases so its users can bring their configs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, ByteSize, Field, SecretStr, field_validator, model_validator

from omni_plugins.settings import ConnectorSettings

MiB = 1 << 20
MIN_SECRET_LENGTH = 16


def parse_host_port(value: str, *, what: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` too) and check the port."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must look like 'host:port', got {value!r}")
    return host, int(port)


class _Engine(ConnectorSettings):
    """What every Mooncake engine needs: where it lives and how it moves bytes."""

    local_hostname: str = Field(
        default="127.0.0.1",
        min_length=1,
        validation_alias=AliasChoices("local_hostname", "host"),
        description="address this process advertises to peers (also exported as MC_TCP_BIND_ADDRESS unless set)",
    )
    protocol: Literal["tcp", "rdma"] = Field(
        default="tcp", validation_alias=AliasChoices("protocol", "proto"), description="transport of the bulk data: tcp, or rdma (with device_name)"
    )
    device_name: str = Field(
        default="",
        validation_alias=AliasChoices("device_name", "rdma", "rdma_devices"),
        description="RDMA device names, comma separated (e.g. 'mlx5_0,mlx5_1'); empty for tcp",
    )

    @field_validator("device_name")
    @classmethod
    def _normalise_devices(cls, value: str) -> str:
        return ",".join(d.strip() for d in value.split(",") if d.strip())


class MooncakeStoreConfig(_Engine):
    """Config of ``mooncake-store``: a ``MooncakeDistributedStore`` client."""

    master_address: str = Field(
        default="127.0.0.1:50051",
        validation_alias=AliasChoices("master_address", "master", "master_server_address"),
        description="host:port of mooncake_master's RPC service",
    )
    metadata_server: str = Field(
        default="P2PHANDSHAKE",
        min_length=1,
        description="'P2PHANDSHAKE' (no metadata service), or an http:// / etcd:// metadata server",
    )
    global_segment_size: ByteSize = Field(
        default=ByteSize(1024 * MiB),
        ge=0,
        validation_alias=AliasChoices("global_segment_size", "segment"),
        description="memory this client contributes to the store; payloads it puts live here",
    )
    local_buffer_size: ByteSize = Field(
        default=ByteSize(16 * MiB),
        gt=0,
        validation_alias=AliasChoices("local_buffer_size", "localbuf"),
        description="Mooncake's own transfer buffer (this connector moves data through its own registered buffers)",
    )
    max_idle_buffer_bytes: ByteSize = Field(
        default=ByteSize(512 * MiB),
        ge=0,
        description="registered staging/receive memory kept for reuse between transfers",
    )
    connect_timeout: float = Field(default=3.0, gt=0, description="seconds to wait for the master to answer a TCP connect")
    poll_interval: float = Field(default=0.002, gt=0, le=1.0, description="first delay between lookups while get() waits")

    @field_validator("master_address")
    @classmethod
    def _check_master(cls, value: str) -> str:
        parse_host_port(value, what="master_address")
        return value.strip()


class MooncakeTEConfig(_Engine):
    """Config of ``mooncake-te``: a ``TransferEngine`` in P2PHANDSHAKE mode plus a small control channel.

    Every instance can produce and consume. As a producer it stages payloads in
    registered memory and answers lookups on ``listen_address``; as a consumer it
    asks each of ``peers`` (producers' listen addresses) where a key is and reads
    it with a one-sided transfer.
    """

    listen_address: str | None = Field(
        default="127.0.0.1:0",
        description="host:port of this instance's control channel (port 0 = any free port); null = consume only",
    )
    peers: list[str] = Field(default_factory=list, description="control addresses of the producers this instance reads from")
    secret: SecretStr | None = Field(
        default=None,
        description="shared secret of the control channel (at least 16 characters; same value on producers and their "
        "consumers; e.g. ${OMNI_TE_SECRET} in YAML). None or empty: each listener generates its own, which reaches "
        "instances in the same process and, through rendezvous_dir, same-user processes on this host",
    )
    pool_size: ByteSize = Field(
        default=ByteSize(2048 * MiB),
        gt=0,
        description="most bytes of payloads staged (put, not yet consumed) at once; a put beyond this fails",
    )
    max_idle_buffer_bytes: ByteSize = Field(
        default=ByteSize(512 * MiB),
        ge=0,
        description="registered memory kept for reuse between transfers",
    )
    rendezvous_dir: str | None = Field(
        default="auto",
        description="same-host discovery: instances announce their listen address as a file here and read from all "
        "others. 'auto' (the default): a directory private to this user and this network namespace, so processes on "
        "one host find each other with no configuration; a path: that directory (separates groups of instances); "
        "null: none",
    )
    metadata_server: str | None = Field(
        default=None,
        description="cross-host discovery: http://host:port/metadata of Mooncake's HTTP metadata server (mooncake_master "
        "--enable_http_metadata_server); producers announce their control address in a roster there, consumers read "
        "from every producer on it. Needs `secret`. None or 'P2PHANDSHAKE': off",
    )
    discovery_group: str = Field(
        default="default",
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="name of the roster on the metadata server: instances read only from producers of the same group",
    )
    discovery_ttl: float = Field(
        default=30.0, ge=3.0, description="seconds a roster entry lives without a heartbeat (producers renew it every third of that)"
    )
    claim_timeout: float = Field(default=60.0, gt=0, description="seconds a consumer may take to read a payload it claimed")
    payload_ttl: float = Field(default=300.0, gt=0, description="seconds after which an unconsumed payload is reclaimed")
    socket_timeout: float = Field(default=5.0, gt=0, description="timeout of every control-channel connect/send/receive")
    poll_interval: float = Field(default=0.002, gt=0, le=1.0, description="first delay between lookups while get() waits")

    @field_validator("listen_address")
    @classmethod
    def _check_listen(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"listen_address must look like 'host:port' (port 0 = any), got {value!r}")
        return value.strip()

    @field_validator("metadata_server")
    @classmethod
    def _check_metadata_server(cls, value: str | None) -> str | None:
        if value is None or value.strip() in ("", "P2PHANDSHAKE"):
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"metadata_server must be Mooncake's HTTP metadata server, http://host:port/metadata; got {value!r}")
        return value.strip()

    @model_validator(mode="after")
    def _discovery_needs_a_secret(self) -> MooncakeTEConfig:
        if self.metadata_server is not None and self.secret is None:
            raise ValueError(
                "metadata_server discovery reaches producers on other hosts, which can only be authenticated with a "
                "configured secret (a generated one never leaves its host): set `secret` on every instance"
            )
        return self

    @field_validator("secret")
    @classmethod
    def _check_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or value.get_secret_value() == "":  # `${VAR:-}` with VAR unset: none configured
            return None
        if len(value.get_secret_value()) < MIN_SECRET_LENGTH:
            raise ValueError(
                f"secret must be at least {MIN_SECRET_LENGTH} characters (e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        return value

    @field_validator("peers")
    @classmethod
    def _check_peers(cls, value: list[str]) -> list[str]:
        for peer in value:
            parse_host_port(peer, what="each peer")
        return [p.strip() for p in value]
