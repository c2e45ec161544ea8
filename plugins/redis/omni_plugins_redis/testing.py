"""Private Redis servers and clusters for tests, benchmarks and soak runs.

Everything binds 127.0.0.1 (or a mode-0700 unix socket directory), lives in
its own temporary directory, and is stopped by pid; an ``atexit`` hook stops
whatever a crashed test left running. Example::

    from omni_plugins_redis.testing import RedisServer, RedisCluster

    with RedisServer(password="s3cret") as server:
        conn = create_connector("redis", server.connector_config(key_prefix="t:"))

    with RedisCluster(masters=3, replicas=1, node_timeout_ms=1500) as cluster:  # a replica per primary
        conn = create_connector("redis", cluster.connector_config())
        killed = cluster.kill(cluster.primary_of(slot))     # SIGKILL
        cluster.wait_promoted(slot, killed)                 # its replica took over
        cluster.revive(killed)                              # back, as a replica of the new primary

    with RedisSentinelGroup(replicas=2, sentinels=3) as group:  # one primary behind Sentinel
        conn = create_connector("redis", group.connector_config())
        old = group.kill_primary()
        group.wait_failover(old)

Options: ``password`` (for the ``default`` user, also what replicas and
Sentinels authenticate with), ``acl_users`` (extra ``user`` directives, e.g.
``["app on >pw ~t:* +get +set"]``), ``tls`` (TLS-only servers; CA, server and
client certificates are made with ``openssl``), ``unix_socket`` (unix socket
only), ``persistent`` (AOF with ``appendfsync always``: survives
:meth:`RedisServer.restart`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from omni_plugins.backoff import poll
from omni_plugins.ports import free_port

REDIS_SERVER = os.environ.get("OMNI_REDIS_SERVER", "redis-server")
REDIS_CLI = os.environ.get("OMNI_REDIS_CLI", "redis-cli")
#: interval of the waits for a topology to settle (omni_plugins.backoff.poll)
POLL_S = 0.05

_live: set[RedisServer] = set()
_live_lock = threading.Lock()


def _stop_leftovers() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        server.stop()


atexit.register(_stop_leftovers)


class TlsFiles:
    """A throwaway CA plus server and client certificates for 127.0.0.1, made with ``openssl``."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ca = directory / "ca.crt"
        self.server_cert, self.server_key = directory / "server.crt", directory / "server.key"
        self.client_cert, self.client_key = directory / "client.crt", directory / "client.key"
        self._make()

    def _run(self, *args: str) -> None:
        subprocess.run(["openssl", *args], cwd=self.dir, check=True, capture_output=True, timeout=60)

    def _make(self) -> None:
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        self._run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=omni-test-ca")
        ext = self.dir / "san.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for name in ("server", "client"):
            self._run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
            self._run(
                "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext",
            )  # fmt: skip
        for key in self.dir.glob("*.key"):
            key.chmod(0o600)


class RedisServer:
    """One private ``redis-server`` (context manager). ``url``/``connector_config()`` tell how to reach it."""

    def __init__(
        self,
        *,
        port: int | None = None,
        password: str | None = None,
        acl_users: Sequence[str] = (),
        tls: bool = False,
        unix_socket: bool = False,
        persistent: bool = False,
        cluster: bool = False,
        extra_args: Sequence[str] = (),
        tls_files: TlsFiles | None = None,
        start_timeout: float = 20.0,
        cluster_node_timeout_ms: int = 5000,
        replica_of: RedisServer | None = None,
        sentinel_monitor: str | None = None,
    ) -> None:
        """``replica_of``: replicate that server; ``sentinel_monitor``: run as a Sentinel with these config lines."""
        self.password = password
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        self.replica_of = replica_of
        self.sentinel_monitor = sentinel_monitor
        self.acl_users = list(acl_users)
        self.tls = tls or tls_files is not None
        self.unix_socket = unix_socket
        self.persistent = persistent
        self.cluster = cluster
        self.extra_args = list(extra_args)
        self.start_timeout = start_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="omni-redis-"))
        self.dir.chmod(0o700)
        self.tls_files = tls_files or (TlsFiles(self.dir) if tls else None)
        self._auto_port = port is None
        self._started_once = False
        self.port = port or free_port(also_plus=10000 if cluster else None)
        self.socket_path = self.dir / "redis.sock" if unix_socket else None
        self.process: subprocess.Popen[bytes] | None = None

    # -- addresses ------------------------------------------------------------
    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>`` (or the unix socket's path); no credentials."""
        return str(self.socket_path) if self.socket_path is not None else f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """How to reach the server (without credentials)."""
        if self.socket_path is not None:
            return f"unix://{self.socket_path}"
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def connector_config(self, **overrides: Any) -> dict[str, Any]:
        """A config dict for ``create_connector("redis", ...)`` reaching this server as ``default``."""
        config: dict[str, Any] = {"url": self.url}
        if self.password is not None:
            config["password"] = self.password
        if self.tls_files is not None:
            config.update(
                tls_ca_file=str(self.tls_files.ca),
                tls_cert_file=str(self.tls_files.client_cert),
                tls_key_file=str(self.tls_files.client_key),
            )
        config.update(overrides)
        return config

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client (default user) for inspecting the server from tests."""
        params: dict[str, Any] = {"password": self.password, "socket_timeout": 10}
        if self.socket_path is not None:
            params["unix_socket_path"] = str(self.socket_path)
        else:
            params.update(host="127.0.0.1", port=self.port)
        if self.tls_files is not None:
            params.update(
                ssl=True,
                ssl_ca_certs=str(self.tls_files.ca),
                ssl_certfile=str(self.tls_files.client_cert),
                ssl_keyfile=str(self.tls_files.client_key),
            )
        params.update(kwargs)
        return redis.Redis(**params)

    def keys(self, pattern: str = "*") -> list[bytes]:
        """Keys matching ``pattern`` (for leak assertions)."""
        client = self.client()
        try:
            return count_keys([client], pattern)
        finally:
            client.close()

    def delete_keys(self, pattern: str) -> int:
        """Delete every key matching ``pattern`` (test clean-up after a failure); how many there were."""
        client = self.client()
        try:
            stale = count_keys([client], pattern)
            if stale:
                client.delete(*stale)
            return len(stale)
        finally:
            client.close()

    # -- lifecycle --------------------------------------------------------------
    def _listen_args(self) -> list[str]:
        if self.socket_path is not None:
            return ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.tls_files is None:
            return ["--port", str(self.port)]
        t = self.tls_files
        args = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(t.server_cert), "--tls-key-file", str(t.server_key)]
        return [*args, "--tls-ca-cert-file", str(t.ca), "--tls-auth-clients", "optional", "--tls-replication", "yes"]

    def _sentinel_args(self) -> list[str]:
        conf = self.dir / "sentinel.conf"  # Sentinel rewrites its config file: it must be its own
        if not conf.exists():
            conf.write_text(f"{self.sentinel_monitor}\n")
        args = [REDIS_SERVER, str(conf), "--sentinel", "--bind", "127.0.0.1", "--dir", str(self.dir), "--logfile", "redis.log"]
        return [*args, "--daemonize", "no", "--protected-mode", "no", *self._listen_args(), *self.extra_args]

    def _args(self) -> list[str]:
        if self.sentinel_monitor is not None:
            return self._sentinel_args()
        args = [REDIS_SERVER, "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "", "--logfile", "redis.log"]
        args += ["--protected-mode", "yes", "--daemonize", "no", *self._listen_args()]
        args += ["--repl-diskless-sync-delay", "0"]  # a replica syncs at once (default: 5 s to gather more replicas)
        if self.tls_files is not None and self.cluster:
            args += ["--tls-cluster", "yes"]
        if self.replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of.port)]
        if self.password is not None and (self.cluster or self.replica_of is not None):
            args += ["--masterauth", self.password]  # replication as the default user (also after a failover)
        return self._data_args(args)

    def _data_args(self, args: list[str]) -> list[str]:
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", str(self.cluster_node_timeout_ms), "--cluster-allow-replica-migration", "no"]
            args += ["--cluster-replica-validity-factor", "0"]  # a replica may always take over (no data-age veto)
        if self.password is not None:
            args += ["--requirepass", self.password]
        for user in self.acl_users:
            args += ["--user", *user.split()]
        return args + self.extra_args

    def start(self) -> RedisServer:
        """Start (or restart) the server and wait until it accepts connections.

        A port taken by someone else between choosing and binding is replaced by a
        fresh one (first start only, when no port was given). On failure the
        server is stopped, its directory removed, and the log tail is raised.
        """
        for attempt in range(3):
            failure = self._start_once()
            if failure is None:
                return self
            retry = self._auto_port and not self._started_once and "address already in use" in failure.lower() and attempt < 2
            self.stop(remove=not retry)
            if not retry:
                raise RuntimeError(failure)
            self.port = free_port(also_plus=10000 if self.cluster else None)
        raise AssertionError("unreachable")

    def _start_once(self) -> str | None:
        log_file = self.dir / "redis.log"
        offset = log_file.stat().st_size if log_file.exists() else 0
        self.process = subprocess.Popen(
            self._args(), cwd=self.dir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        with _live_lock:
            _live.add(self)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                return f"redis-server exited with {self.process.returncode}: {err.strip()} {self._log_tail(offset)}"
            ready = "+monitor master" if self.sentinel_monitor is not None else "ready to accept connections"
            if log_file.exists() and ready in log_file.read_text(errors="replace")[offset:].lower():
                self._started_once = True
                return None
            time.sleep(0.02)
        return f"redis-server on port {self.port} not ready after {self.start_timeout}s: {self._log_tail(offset)}"

    def _log_tail(self, offset: int = 0) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "redis.log").read_text(errors="replace")[offset:][-2000:]
        return ""

    def _terminate(self, sig: int = signal.SIGTERM) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
        if proc.stderr:
            proc.stderr.close()

    def restart(self, *, kill: bool = False, down_for: float = 0.0) -> None:
        """Stop (SIGTERM, or SIGKILL with ``kill``) and start again on the same port and data dir."""
        self._terminate(signal.SIGKILL if kill else signal.SIGTERM)
        if down_for:
            time.sleep(down_for)
        self.start()

    def stop(self, *, remove: bool = True) -> None:
        """Stop the server by pid and (by default) delete its directory. Idempotent."""
        self._terminate()
        with _live_lock:
            _live.discard(self)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisCluster:
    """A Redis Cluster of ``masters`` primaries, each with ``replicas`` replicas, built with ``redis-cli --cluster create``.

    ``node_timeout_ms`` (``cluster-node-timeout``) bounds how long a dead
    primary goes unnoticed: its replica takes over a few seconds after.
    """

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 0,
        password: str | None = None,
        acl_users: Sequence[str] = (),
        persistent: bool = False,
        tls: bool = False,
        node_timeout_ms: int = 5000,
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.password = password
        self.replicas = replicas
        self._tls_dir = Path(tempfile.mkdtemp(prefix="omni-redis-tls-")) if tls else None
        self.tls_files = TlsFiles(self._tls_dir) if self._tls_dir is not None else None
        self.nodes = [
            RedisServer(
                password=password,
                acl_users=acl_users,
                persistent=persistent,
                cluster=True,
                tls_files=self.tls_files,
                cluster_node_timeout_ms=node_timeout_ms,
            )
            for _ in range(masters * (1 + replicas))
        ]

    @property
    def startup_nodes(self) -> list[str]:
        return [f"127.0.0.1:{n.port}" for n in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def connector_config(self, **overrides: Any) -> dict[str, Any]:
        config: dict[str, Any] = {"cluster": True, "startup_nodes": self.startup_nodes}
        if self.password is not None:
            config["password"] = self.password
        if self.tls_files is not None:
            t = self.tls_files
            config.update(tls=True, tls_ca_file=str(t.ca), tls_cert_file=str(t.client_cert), tls_key_file=str(t.client_key))
        config.update(overrides)
        return config

    def clients(self) -> list[redis.Redis]:
        return [n.client() for n in self.nodes]

    def keys(self, pattern: str = "*") -> list[bytes]:
        """Keys matching ``pattern`` on every running node (for leak assertions)."""
        return [k for node in self.live_nodes for k in node.keys(pattern)]

    @property
    def live_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes if n.pid is not None]

    # -- failover ---------------------------------------------------------------
    def primary_of(self, slot: int) -> RedisServer:
        """The node serving ``slot`` now, as the running nodes see it."""
        for node in self.live_nodes:
            client = node.client()
            try:
                for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        return self._node(int(primary[1]))
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise RuntimeError(f"no running node knows who serves slot {slot}")

    def _node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def kill(self, node: RedisServer) -> RedisServer:
        """SIGKILL ``node`` (its data directory stays, for :meth:`revive`)."""
        node._terminate(signal.SIGKILL)
        return node

    def wait_promoted(self, slot: int, dead: RedisServer, timeout: float = 60.0) -> RedisServer:
        """Wait until a replica of ``dead`` serves ``slot`` and the cluster is whole again; returns it."""

        def promoted() -> RedisServer | None:
            with contextlib.suppress(RuntimeError, StopIteration):
                primary = self.primary_of(slot)
                if primary is not dead and self._cluster_ok(self.live_nodes):
                    return primary
            return None

        found = poll(promoted, timeout, POLL_S)
        if found is None:
            raise RuntimeError(f"no replica took over slot {slot} within {timeout}s")
        return found

    def revive(self, node: RedisServer, timeout: float = 60.0) -> None:
        """Restart a killed node: it rejoins (a former primary as a replica) and catches up with its primary."""
        node.start()
        client = node.client()

        def rejoined() -> bool | None:
            with contextlib.suppress(redis.RedisError):
                info = client.info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up" and self._cluster_ok(self.live_nodes):
                    return True
            return None

        try:
            if poll(rejoined, timeout, POLL_S):
                return
        finally:
            client.close()
        raise RuntimeError(f"node {node.port} did not rejoin as a replica within {timeout}s")

    def start(self) -> RedisCluster:
        try:
            for node in self.nodes:
                node.start()
            cmd = [REDIS_CLI, "--cluster", "create", *self.startup_nodes, "--cluster-replicas", str(self.replicas), "--cluster-yes"]
            if self.tls_files is not None:
                t = self.tls_files
                cmd += ["--tls", "--cacert", str(t.ca), "--cert", str(t.client_cert), "--key", str(t.client_key)]
            env = dict(os.environ)
            if self.password:
                env["REDISCLI_AUTH"] = self.password
            done = subprocess.run(cmd, capture_output=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout.decode(errors='replace')[-1500:]}")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, timeout: float = 30.0) -> None:
        if not poll(lambda: (self._cluster_ok(self.nodes) and self._replicas_synced()) or None, timeout, POLL_S):
            raise RuntimeError("cluster did not reach cluster_state:ok")

    @staticmethod
    def _cluster_ok(nodes: Sequence[RedisServer]) -> bool:
        """Every node answers and reports ``cluster_state:ok``."""
        for node in nodes:
            client = node.client()
            try:
                if b"cluster_state:ok" not in _as_bytes(client.execute_command("CLUSTER", "INFO")):
                    return False
            except redis.RedisError:
                return False
            finally:
                client.close()
        return True

    def _replicas_synced(self) -> bool:
        """Every primary has its ``replicas`` replicas online."""
        online = 0
        for node in self.nodes:
            client = node.client()
            try:
                info = client.info("replication")
            except redis.RedisError:
                return False
            finally:
                client.close()
            if info.get("role") == "master":
                online += sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")
        return online == self.replicas * (len(self.nodes) // (1 + self.replicas))

    def restart(self, *, kill: bool = False) -> None:
        for node in self.nodes:
            node.restart(kill=kill)
        self._wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisSentinelGroup:
    """One primary with ``replicas`` replicas, watched by ``sentinels`` Redis Sentinels (quorum: a majority).

    ``down_after_ms`` (``down-after-milliseconds``) bounds how long a dead
    primary goes unnoticed; the Sentinels then promote a replica and point the
    others at it. ``password`` is the ``default`` user's on every data node
    (replication and Sentinels use it); the Sentinels themselves need none.
    """

    def __init__(
        self,
        *,
        replicas: int = 2,
        sentinels: int = 3,
        service_name: str = "omnitest",
        password: str | None = None,
        acl_users: Sequence[str] = (),
        tls: bool = False,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 10000,
    ) -> None:
        self.service_name = service_name
        self.password = password
        self._tls_dir = Path(tempfile.mkdtemp(prefix="omni-redis-tls-")) if tls else None
        self.tls_files = TlsFiles(self._tls_dir) if self._tls_dir is not None else None
        # the primary also authenticates as a replica: once demoted, the Sentinels point it at the new primary
        demoted_auth = ["--masterauth", password] if password is not None else []
        self.primary = RedisServer(password=password, acl_users=acl_users, tls_files=self.tls_files, extra_args=demoted_auth)
        self.replicas = [
            RedisServer(password=password, acl_users=acl_users, tls_files=self.tls_files, replica_of=self.primary) for _ in range(replicas)
        ]
        quorum = sentinels // 2 + 1
        monitor = [f"sentinel monitor {service_name} 127.0.0.1 {self.primary.port} {quorum}"]
        monitor += [f"sentinel down-after-milliseconds {service_name} {down_after_ms}"]
        monitor += [f"sentinel failover-timeout {service_name} {failover_timeout_ms}", f"sentinel parallel-syncs {service_name} {replicas}"]
        if password is not None:
            monitor.append(f"sentinel auth-pass {service_name} {password}")
        self.sentinels = [
            RedisServer(tls_files=self.tls_files, sentinel_monitor="\n".join(monitor)) for _ in range(max(sentinels, 1))
        ]

    @property
    def data_nodes(self) -> list[RedisServer]:
        return [self.primary, *self.replicas]

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in [*self.data_nodes, *self.sentinels] if n.pid is not None]

    def connector_config(self, **overrides: Any) -> dict[str, Any]:
        """A config dict reaching the current primary through the Sentinels, as ``default``."""
        config: dict[str, Any] = {"sentinels": [f"127.0.0.1:{s.port}" for s in self.sentinels], "service_name": self.service_name}
        if self.password is not None:
            config["password"] = self.password
        if self.tls_files is not None:
            t = self.tls_files
            config.update(tls=True, tls_ca_file=str(t.ca), tls_cert_file=str(t.client_cert), tls_key_file=str(t.client_key))
        config.update(overrides)
        return config

    def keys(self, pattern: str = "*") -> list[bytes]:
        """Keys matching ``pattern`` on every running data node (for leak assertions)."""
        return [k for node in self.data_nodes if node.process is not None and node.process.poll() is None for k in node.keys(pattern)]

    def current_primary(self) -> RedisServer:
        """The data node the Sentinels name as primary now."""
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                address = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service_name)
                return next(n for n in self.data_nodes if n.port == int(address[1]))
            except (redis.RedisError, TypeError, IndexError, StopIteration):
                continue
            finally:
                client.close()
        raise RuntimeError(f"no Sentinel names a primary for {self.service_name!r}")

    def kill_primary(self) -> RedisServer:
        """SIGKILL the current primary; returns it (its data directory stays)."""
        primary = self.current_primary()
        primary._terminate(signal.SIGKILL)
        return primary

    def wait_failover(self, old: RedisServer, timeout: float = 60.0) -> RedisServer:
        """Wait until the Sentinels promoted another node and every other running node replicates it; returns it."""

        def replaced() -> RedisServer | None:
            with contextlib.suppress(RuntimeError):
                primary = self.current_primary()
                if primary is not old and self._replicating(primary):
                    return primary
            return None

        found = poll(replaced, timeout, POLL_S)
        if found is None:
            raise RuntimeError(f"the Sentinels did not replace primary {old.port} within {timeout}s")
        return found

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Wait until every running data node replicates the current primary and every Sentinel knows the others.

        After a failover that brought a killed primary back as a replica, its resync and the Sentinels'
        reconfiguration take a while; a test starting before then would find a replica short (a put with
        ``min_replica_acks`` fails for want of it).
        """

        def whole() -> bool | None:
            with contextlib.suppress(RuntimeError):
                primary = self.current_primary()
                return (self._replicating(primary) and all(self._sentinel_sees_all(s) for s in self.sentinels)) or None
            return None

        if not poll(whole, timeout, POLL_S):
            raise RuntimeError(f"the Sentinel group of {self.service_name!r} did not come back together within {timeout}s")

    def _replicating(self, primary: RedisServer) -> bool:
        for node in self.data_nodes:
            if node is primary or node.process is None or node.process.poll() is not None:
                continue
            client = node.client()
            try:
                info = client.info("replication")
            except redis.RedisError:
                return False
            finally:
                client.close()
            if info.get("master_port") != primary.port or info.get("master_link_status") != "up":
                return False
        return True

    def start(self) -> RedisSentinelGroup:
        try:
            for node in self.data_nodes:
                node.start()
            for sentinel in self.sentinels:
                sentinel.start()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float = 30.0) -> None:
        """Replicas in sync, and every Sentinel knows the replicas and the other Sentinels (else a failover could stall)."""

        def ready() -> bool | None:
            return (self._replicating(self.primary) and all(self._sentinel_sees_all(s) for s in self.sentinels)) or None

        if not poll(ready, timeout, POLL_S):
            raise RuntimeError("the Sentinel group did not come together")

    def _sentinel_sees_all(self, sentinel: RedisServer) -> bool:
        client = sentinel.client()
        try:
            replicas = client.execute_command("SENTINEL", "REPLICAS", self.service_name)
            others = client.execute_command("SENTINEL", "SENTINELS", self.service_name)
        except redis.RedisError:
            return False
        finally:
            client.close()
        return len(replicas) == len(self.replicas) and len(others) == len(self.sentinels) - 1

    def stop(self) -> None:
        for node in [*self.sentinels, *self.data_nodes]:
            node.stop()
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)

    def __enter__(self) -> RedisSentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def count_keys(clients: Sequence[redis.Redis], pattern: str) -> list[bytes]:
    """All keys matching ``pattern`` across the given servers (for leak assertions)."""
    found: list[bytes] = []
    for client in clients:
        found.extend(client.scan_iter(match=pattern, count=1000))
    return found
