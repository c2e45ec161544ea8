"""Where a slot's commands go: redis-py's pools, Sentinel and cluster slot map behind one small interface.

Connections, connection pools (``BlockingConnectionPool``), TLS, ACL and
password or credential-provider authentication, Sentinel's primary discovery
(``Sentinel.master_for``; :mod:`.sentinel` picks the newest primary named) and
Redis Cluster's slot map (``RedisCluster``) are redis-py's. The connector asks only two things: which pool serves this slot
now (:meth:`Topology.route`), and, after a failure, that the next route looks
again (:meth:`Topology.failed`). redis-py's own retries are off on every
connection (``Retry(NoBackoff(), 0)``): the connector retries whole steps
(:mod:`.client`), which keep their progress across attempts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import ConnectionPool
from redis.exceptions import AskError, ClusterDownError, ReadOnlyError, RedisClusterException, TryAgainError
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

from omni_plugins_redis.cleanup import NodeQueue
from omni_plugins_redis.config import RedisConfig, load_credential_provider
from omni_plugins_redis.connection import (
    OmniConnection,
    OmniSentinelConnection,
    OmniSentinelSSLConnection,
    OmniSSLConnection,
    OmniUnixConnection,
)
from omni_plugins_redis.sentinel import NewestSentinel


class Route:
    """One server: its redis-py pool, its name (for error messages), its cleanup queue and its kept connections.

    ``kept`` holds connections checked out of ``pool`` that served a step well,
    for the next step (see ``RedisClient._use``). Made once per server and
    reused, so the hot path finds all of it without a lookup.
    """

    __slots__ = ("kept", "name", "pool", "queue")

    def __init__(self, pool: ConnectionPool, name: str) -> None:
        self.pool = pool
        self.name = name
        self.queue = NodeQueue()
        self.kept: list[Any] = []


class Topology(Protocol):
    label: str

    def route(self, slot: int) -> Route: ...

    def failed(self, route: Route | None, error: BaseException) -> bool:
        """Note a failed step; True when ``route``'s server may be gone for good (its pending cleanup re-routes)."""
        ...

    def primaries(self) -> list[Route]: ...

    def routes(self) -> list[Route]:
        """Every server routed to so far (for close())."""
        ...

    def close(self) -> None: ...


def auth_and_timeouts(config: RedisConfig) -> dict[str, Any]:
    """Keyword arguments of every data connection (redis-py ``Connection``)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.connect_timeout,
        "retry": Retry(NoBackoff(), 0),
        "protocol": config.protocol,
        "driver_info": None,  # no CLIENT SETINFO: one command less per connect, none an ACL user must be granted
    }
    if config.credential_provider:
        kwargs["credential_provider"] = load_credential_provider(config.credential_provider)
    else:
        kwargs["username"] = config.username
        kwargs["password"] = config.password.get_secret_value() if config.password is not None else None
    return kwargs


def tls_options(config: RedisConfig) -> dict[str, Any]:
    return {
        "ssl_ca_certs": str(config.tls_ca_file) if config.tls_ca_file else None,
        "ssl_certfile": str(config.tls_cert_file) if config.tls_cert_file else None,
        "ssl_keyfile": str(config.tls_key_file) if config.tls_key_file else None,
        "ssl_check_hostname": config.tls_check_hostname,
        "ssl_cert_reqs": "required",
    }


class OneServer:
    """A topology of one route: every slot goes to the same pool, and no failure changes that.

    A standalone server is such a route; so is Sentinel's primary, whose pool
    finds the current primary itself when a connection connects. ``on_close``
    releases what the route's maker holds besides the pool (the Sentinels).
    """

    def __init__(self, label: str, route: Route, on_close: Callable[[], None] | None = None) -> None:
        self.label = label
        self._route = route
        self._on_close = on_close

    def route(self, slot: int) -> Route:
        return self._route

    def failed(self, route: Route | None, error: BaseException) -> bool:
        return False

    def primaries(self) -> list[Route]:
        return [self._route]

    def routes(self) -> list[Route]:
        return [self._route]

    def close(self) -> None:
        self._route.pool.disconnect(inuse_connections=False)
        if self._on_close is not None:
            self._on_close()


def standalone(config: RedisConfig) -> OneServer:
    """One server (TCP, TLS or unix socket) through one ``BlockingConnectionPool``."""
    kwargs = auth_and_timeouts(config)
    kwargs.update(db=config.db, max_connections=config.pool_size, timeout=config.pool_timeout)
    if config.unix_socket:
        kwargs.update(connection_class=OmniUnixConnection, path=config.unix_socket)
        name = f"unix://{config.unix_socket}"
    else:
        kwargs.update(host=config.host, port=config.port, connection_class=OmniConnection)
        name = f"{config.host}:{config.port}"
        if config.tls:
            kwargs.update(connection_class=OmniSSLConnection, **tls_options(config))
    return OneServer(config.server_label(), Route(redis.BlockingConnectionPool(**kwargs), name))


def sentinel_for(config: RedisConfig) -> NewestSentinel:
    """The config's Sentinels (their own credentials; TLS like the data nodes), following the newest primary they name."""
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.connect_timeout,
        "username": config.sentinel_username,
        "password": config.sentinel_password.get_secret_value() if config.sentinel_password is not None else None,
        "driver_info": None,
        "protocol": 2,
    }
    if config.tls:
        sentinel_kwargs.update(ssl=True, **tls_options(config))
    return NewestSentinel(config.sentinel_nodes(), sentinel_kwargs=sentinel_kwargs)


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's pool (connections find the current primary when they connect) that waits for a free connection."""


def sentinel_primary(config: RedisConfig) -> OneServer:
    """The primary Redis Sentinel names for ``service_name``; connections re-ask the Sentinels after a failover.

    A connection to a demoted primary is dropped on its first ``READONLY`` reply
    (redis-py's ``SentinelManagedConnection``) and one to a dead primary fails;
    either way the step is retried and the new connection goes to the new primary.
    """
    label = config.server_label()
    kwargs = auth_and_timeouts(config)
    connection_class: type[OmniSentinelConnection | OmniSentinelSSLConnection] = OmniSentinelConnection
    if config.tls:
        connection_class = OmniSentinelSSLConnection
        kwargs.update(tls_options(config))
    sentinel = sentinel_for(config)
    client = sentinel.master_for(
        config.service_name or "",
        connection_pool_class=_BlockingSentinelPool,
        connection_class=connection_class,
        db=config.db,
        max_connections=config.pool_size,
        timeout=config.pool_timeout,
        **kwargs,
    )
    return OneServer(label, Route(client.connection_pool, f"{config.service_name} at {label}"), sentinel.close)


# Failures after which the slot map may be stale: refresh it before the next attempt.
_STALE_MAP = (
    ConnectionError,
    TimeoutError,
    OSError,
    redis.ConnectionError,
    redis.TimeoutError,
    AskError,
    ClusterDownError,
    TryAgainError,
    ReadOnlyError,
)


class Cluster:
    """Redis Cluster through ``RedisCluster``'s slot map (``CLUSTER SLOTS``), refreshed after redirects and failures.

    Built on first use (redis-py connects while it builds the map), so a
    connector can be created while the cluster is still starting.
    """

    def __init__(self, config: RedisConfig) -> None:
        self.label = config.server_label()
        self._nodes = config.nodes()
        kwargs = auth_and_timeouts(config)
        kwargs.update(
            max_connections=config.pool_size,
            timeout=config.pool_timeout,
            connection_pool_class=redis.BlockingConnectionPool,
            connection_class=OmniSSLConnection if config.tls else OmniConnection,
        )
        if config.tls:
            kwargs.update(ssl=True, **tls_options(config))
        self._kwargs = kwargs
        self._client: RedisCluster | None = None
        self._routes: dict[str, Route] = {}  # by node name: kept across slot map refreshes
        self._stale = False
        self._lock = threading.Lock()
        self._closed = False

    def _cluster(self) -> RedisCluster:
        client = self._client
        if client is not None and not self._stale:
            return client
        with self._lock:
            if self._closed:
                raise redis.ConnectionError(f"Redis Cluster {self.label}: the client is closed")
            try:
                if self._client is None:
                    startup = [ClusterNode(host, port) for host, port in self._nodes]
                    self._client = RedisCluster(startup_nodes=startup, require_full_coverage=False, **self._kwargs)
                elif self._stale:
                    self._stale = False
                    self._client.nodes_manager.initialize()
            except RedisClusterException as exc:  # e.g. no startup node reachable: retried like a connection failure
                self._stale = True
                raise redis.ConnectionError(f"Redis Cluster {self.label}: {exc}") from None
            return self._client

    def route(self, slot: int) -> Route:
        cluster = self._cluster()
        try:
            node = cluster.nodes_manager.get_node_from_slot(slot)
        except RedisClusterException as exc:  # slot not covered (e.g. mid-failover): look again after a backoff
            self._stale = True
            raise ClusterDownError(f"slot {slot}: {exc}") from None
        return self._route_of(cluster, node)

    def _route_of(self, cluster: RedisCluster, node: ClusterNode) -> Route:
        pool = cluster.get_redis_connection(node).connection_pool
        route = self._routes.get(node.name)
        if route is None or route.pool is not pool:
            with self._lock:
                route = self._routes.get(node.name)
                if route is None or route.pool is not pool:
                    fresh = Route(pool, node.name)
                    if route is not None:  # a new pool for the same address: its cleanup still has to go there
                        fresh.queue.add(route.queue.take_all())
                    route = self._routes[node.name] = fresh
        return route

    def routes(self) -> list[Route]:
        """Every server routed to so far (for close())."""
        with self._lock:
            return list(self._routes.values())

    def failed(self, route: Route | None, error: BaseException) -> bool:
        if isinstance(error, _STALE_MAP):
            self._stale = True
        return isinstance(error, ConnectionError | TimeoutError | OSError | redis.ConnectionError | redis.TimeoutError)

    def primaries(self) -> list[Route]:
        cluster = self._cluster()
        return [self._route_of(cluster, node) for node in cluster.get_primaries()]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client = self._client
        if client is not None:
            for node in list(client.nodes_manager.nodes_cache.values()):
                if node.redis_connection is not None:
                    node.redis_connection.connection_pool.disconnect(inuse_connections=False)


def build(config: RedisConfig) -> Topology:
    if config.cluster:
        return Cluster(config)
    if config.sentinels:
        return sentinel_primary(config)
    return standalone(config)
