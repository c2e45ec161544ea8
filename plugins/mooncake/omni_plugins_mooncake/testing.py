"""Launchers for tests and benchmarks: a loopback-only ``mooncake_master`` you can kill and restart.

Example::

    from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment

    loopback_environment()
    with MooncakeMaster() as master:
        conn = create_connector("mooncake-store", {"master_address": master.address,
                                                   "global_segment_size": "256MiB"})

Every socket the master opens binds 127.0.0.1 (RPC and metrics; the HTTP
metadata server stays off). The process is stopped by pid, never by name.

Mooncake's TransferEngine (inside every store client and ``mooncake-te``
connector) binds its handshake port on ``0.0.0.0`` and its TCP data port on
``::`` whatever the settings (see docs/operations/security.md). To keep a test or a
single-host pipeline unreachable from other hosts anyway, run it in a private
network namespace that only has loopback: :func:`loopback_namespace_command`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from omni_plugins.ports import LOOPBACK, free_port


def loopback_environment() -> None:
    """Make Mooncake engines in this process (and children) use loopback and log only errors."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def loopback_namespace_command(argv: list[str]) -> list[str]:
    """``argv`` wrapped to run in a new user + network namespace whose only interface is ``lo`` (brought up).

    Every process started inside shares that namespace, so wildcard listeners
    (Mooncake's engine ports) are reachable through loopback only. Needs
    ``unshare`` (util-linux) and ``ip`` (iproute2) and unprivileged user
    namespaces; check with :func:`loopback_namespace_available`.
    """
    return ["unshare", "--user", "--map-root-user", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


def loopback_namespace_available(timeout: float = 10.0) -> bool:
    """True when :func:`loopback_namespace_command` works on this machine."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    try:
        done = subprocess.run(loopback_namespace_command(["true"]), capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launching process dies (Linux), so no master outlives a killed test run."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def find_master_binary() -> str:
    """``mooncake_master``: next to this interpreter (an unactivated venv), on PATH, or inside the wheel."""
    # the interpreter's own (venv) binary first: it matches the installed mooncake module
    candidates = [str(Path(sys.executable).parent / "mooncake_master"), shutil.which("mooncake_master")]
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        candidates += [str(Path(loc) / "mooncake_master") for loc in spec.submodule_search_locations]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return candidate
    raise RuntimeError("mooncake_master not found (PATH, interpreter dir, mooncake package): pip install 'omni-plugins-mooncake[cpu]'")


def _answers(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """A ``mooncake_master`` on free loopback ports; a context manager.

    ``address`` is ``"127.0.0.1:<rpc_port>"`` (the connector's ``master_address``).
    ``restart()`` brings it back on the same ports (with empty metadata, as a real
    master restart does); ``stop()`` terminates it and waits.
    """

    def __init__(
        self,
        *,
        lease_ttl_ms: int = 500,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
        start_timeout: float = 15.0,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.binary = binary or find_master_binary()
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_args = tuple(extra_args)
        self.start_timeout = start_timeout
        self._log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir())
        self.rpc_port = 0
        self.metrics_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.launched_pids: list[int] = []  # every master process this object started (for leak checks)

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def connector_config(self, **overrides: Any) -> dict[str, Any]:
        """A ``mooncake-store`` config (a stage's ``extra``) reaching this master, with ``overrides`` applied."""
        return {"master_address": self.address, **overrides}

    def command(self) -> list[str]:
        return [
            self.binary,
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false",
            *self.extra_args,
        ]

    def start(self) -> MooncakeMaster:
        """Start on fresh free ports (retried when a port was taken meanwhile)."""
        last = ""
        for _ in range(5):
            self.rpc_port, self.metrics_port = free_port(), free_port()
            try:
                self._launch()
                return self
            except RuntimeError as exc:
                last = str(exc)
        raise RuntimeError(f"mooncake_master did not start: {last}")

    def restart(self) -> MooncakeMaster:
        """Stop and start again on the same ports (clients reconnect by themselves)."""
        self.stop(keep_log=True)
        self._launch()
        return self

    def kill(self) -> None:
        """SIGKILL the master (a crash), without a clean shutdown; ``restart()`` brings it back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self, *, keep_log: bool = False) -> None:
        """Terminate by pid and wait (SIGKILL after 5 s); the log file is removed unless ``keep_log``."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if not keep_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def _launch(self) -> None:
        self.log_path = self._log_dir / f"mooncake_master-{os.getpid()}-{self.rpc_port}.log"
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        self.launched_pids.append(self.proc.pid)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"exited with code {code}; see {self.log_path}")
            if _answers(LOOPBACK, self.rpc_port):
                return
            time.sleep(0.02)
        self.stop(keep_log=True)
        raise RuntimeError(f"no answer on {self.address} within {self.start_timeout} s; see {self.log_path}")

    def key_count(self, timeout: float = 5.0) -> int:
        """Objects the master holds now: its ``master_key_count`` metric over loopback HTTP.

        Unlike a probe client's ``remove_all`` this leaves the objects alone, so a
        running pipeline can be checked for leftovers.
        """
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=timeout) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("master_key_count "):
                    return int(float(line.split()[1]))
        raise RuntimeError(f"mooncake_master at {self.address}: its metrics have no master_key_count")

    def settled_key_count(self, timeout: float = 10.0) -> int:
        """:meth:`key_count` once it is 0, or after ``timeout`` s whatever it is then.

        Consumed objects are removed by each store connector's background
        remover, so a count taken right after the last ``get`` may still see them.
        """
        deadline = time.monotonic() + timeout
        while (count := self.key_count()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return count

    def __enter__(self) -> MooncakeMaster:
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop(keep_log=exc is not None)
