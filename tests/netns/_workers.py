"""Bodies of the processes that run inside test hosts (importable by the fork server).

A producer puts numbered payloads at a steady pace and reports every put as it
returns; a consumer gets the keys it is handed and reports every attempt. Each
report is a tuple on one shared queue, so the test sees progress (and which
call is still running) even while a network fault holds a call up.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from typing import Any

SIZE = 1 << 20


def payload(seed: int, i: int, size: int = SIZE) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    return {"blob": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g), "meta": {"i": i, "seed": seed}}


def digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(data["blob"].numpy().tobytes()).hexdigest() + f":{data['meta']['i']}"


def _connector(name: str, config: dict[str, Any], address: str) -> Any:
    os.environ["MC_TCP_BIND_ADDRESS"] = address  # Mooncake engines bind this host's test address
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from omni_plugins import create_connector

    return create_connector(name, config)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def produce(
    role: str, name: str, config: dict[str, Any], address: str, prefix: str, count: int, interval: float, seed: int, events: Any, stop: Any
) -> None:
    """Put ``count`` payloads (keys ``prefix0``...), one every ``interval`` s; stay open until ``stop`` is set."""
    try:
        conn = _connector(name, config, address)
    except BaseException as exc:
        events.put((role, "failed", _describe(exc), traceback.format_exc()))
        return
    try:
        events.put((role, "ready", getattr(conn, "address", None)))
        for i in range(count):
            key, data = f"{prefix}{i}", payload(seed, i)
            events.put((role, "putting", key))
            started = time.monotonic()
            try:
                outcome = "ok" if conn.put("0", "1", key, data).ok else "not ok"
            except Exception as exc:
                outcome = _describe(exc)
            events.put((role, "put", key, outcome, time.monotonic() - started, digest(data)))
            time.sleep(interval)
        events.put((role, "produced"))
        stop.wait(600)
        events.put((role, "health", conn.health()))
    except BaseException as exc:
        events.put((role, "failed", _describe(exc), traceback.format_exc()))
    finally:
        conn.close()
        events.put((role, "closed"))


def consume(role: str, name: str, config: dict[str, Any], address: str, keys: Any, get_timeout: float, patience: float, events: Any) -> None:
    """Get each ``(key, digest)`` handed over ``keys`` (None ends), retrying a failed or empty get for ``patience`` s."""
    try:
        conn = _connector(name, config, address)
    except BaseException as exc:
        events.put((role, "failed", _describe(exc), traceback.format_exc()))
        return
    try:
        events.put((role, "ready", None))
        while (item := keys.get()) is not None:
            key, expected = item
            give_up = time.monotonic() + patience
            while True:
                events.put((role, "getting", key))
                started = time.monotonic()
                try:
                    got = conn.get("0", "1", key, timeout=get_timeout)
                    outcome = "none" if got is None else ("intact" if digest(got.data) == expected else "CORRUPT")
                    del got
                except Exception as exc:
                    outcome = _describe(exc)
                events.put((role, "get", key, outcome, time.monotonic() - started))
                if outcome in ("intact", "CORRUPT") or time.monotonic() > give_up:
                    break
        events.put((role, "health", conn.health()))
    except BaseException as exc:
        events.put((role, "failed", _describe(exc), traceback.format_exc()))
    finally:
        conn.close()
        events.put((role, "closed"))
