"""Free TCP ports on loopback: the one helper every private server and process group uses."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK, *, also_plus: int | None = None) -> int:
    """A TCP port on ``host`` that is free now (and ``port + also_plus`` too, e.g. a Redis Cluster bus port).

    Free *now*: another process may take it before the caller binds it, so a caller that
    starts a server on it retries with a fresh port when the bind fails.
    """
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if also_plus is None:
            return port
        if port + also_plus > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s2:
            try:
                s2.bind((host, port + also_plus))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port{' pair' if also_plus is not None else ''} found on {host}")
