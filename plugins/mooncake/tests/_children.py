"""Child-process body for the cross-process test (importable by ``spawn``)."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

BIG = 64 << 20


def big_payload(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"blob": torch.randint(0, 256, (BIG,), dtype=torch.uint8, generator=g), "meta": {"seed": seed}}


def digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(payload["blob"].numpy().tobytes()).hexdigest()


def produce(specs: dict[str, dict[str, Any]], key: str, seed: int, ready: Any, done: Any, report: Any) -> None:
    """Put one 64 MiB payload through each connector in ``specs``; stay alive until told; report health."""
    from omni_plugins_mooncake.testing import loopback_environment

    loopback_environment()
    from omni_plugins import create_connector

    conns = {name: create_connector(name, config) for name, config in specs.items()}
    try:
        payload = big_payload(seed)
        for conn in conns.values():
            assert conn.put(0, 1, key, payload).ok
        ready.put(({name: getattr(c, "address", None) for name, c in conns.items()}, digest(payload)))
        done.wait(120)
        for _ in range(200):  # a reader's one-way "finish" may still be in flight
            if all(c.health().get("staged", 0) == 0 for c in conns.values()):
                break
            time.sleep(0.05)
        report.put({name: c.health() for name, c in conns.items()})
    finally:
        for conn in conns.values():
            conn.close()


def produce_small(config: dict[str, Any], key: str, ready: Any, done: Any, report: Any) -> None:
    """A ``mooncake-te`` producer holding one small payload under ``key`` until told; reports health and its config's text."""
    from omni_plugins_mooncake.testing import loopback_environment

    loopback_environment()
    import torch

    from omni_plugins import create_connector

    try:
        conn = create_connector("mooncake-te", config)
    except Exception as exc:  # let the test fail at once, not at its queue timeout
        ready.put(f"error: {exc!r}")
        raise
    try:
        assert conn.put(0, 1, key, {"v": torch.arange(1000), "key": key}).ok
        ready.put(conn.address)  # type: ignore[attr-defined]
        done.wait(120)
        for _ in range(200):  # a reader's one-way "finish" may still be in flight
            if conn.health()["staged"] == 0:
                break
            time.sleep(0.05)
        report.put({"health": conn.health(), "texts": [repr(conn.config), str(conn.config), conn.config.model_dump_json()]})
    finally:
        conn.close()


#: the user the cross-user tests act as (nobody) when they run as root
OTHER_UID = 65534


def other_user_available() -> bool:
    """Root, and uid/gid :data:`OTHER_UID` exist in this user namespace.

    The CI runs pytest in a private user namespace (loopback-only network) where only root is
    mapped; there a process cannot become another user, and the cross-user parts run as this user.
    """
    if os.getuid() != 0:
        return False
    for table in ("/proc/self/uid_map", "/proc/self/gid_map"):
        try:
            with open(table) as f:
                rows = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
        except OSError:
            return False
        if not any(inside <= OTHER_UID < inside + count for inside, _outside, count in rows):
            return False
    return True
