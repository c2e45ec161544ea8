"""Child processes of the plugin's multi-process tests, and the parent's handle on one.

The children's bodies live in the installed package, not in the tests' folder: a child started
by ``spawn`` or a fork server unpickles its target by module name, and this one imports whatever
the test process's ``sys.path`` and pytest's import mode (the tests run alone from their folder,
in the whole suite and under pytest-xdist alike).

Parent and child talk over a pipe, and every wait is for an event, never for a time budget: the
child answers ``("ready", value)`` (or ``("error", text)``), stays until the parent sends
``"done"`` or goes away (the pipe's end of file: a killed test run leaves no child behind), then
answers ``("report", value)`` and exits. The parent waits for each answer or for the child's
exit, whichever comes first (:class:`Child`).

A child runs with its parent's environment as of its start, as a forked one would: a fork
server's children otherwise inherit the server's, fixed when the process's first child started
(so a test's own ``XDG_RUNTIME_DIR``, and with it its private default rendezvous, reaches them).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any, TypeVar

from omni_plugins.testing.processes import process_context

T = TypeVar("T")

#: what the parent sends when the child may report and exit
DONE = "done"
#: bytes of the payload :func:`produce` puts
BIG = 64 << 20
#: seconds between two looks at a producer's staged payloads while a reader's one-way "finish" is on its way
_DRAIN_POLL = 0.05
#: seconds of one blocking ``get`` of a child that waits for a key as long as its parent does
_GET_SLICE = 1.0


class Child:
    """A child process running ``target(*args, conn)``, started from :func:`process_context`; a context manager.

    Leaving the ``with`` block closes the pipe (a child still holding on exits) and joins the child.
    """

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = process_context()
        self._conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_in_environment, args=(dict(os.environ), target, *args, theirs), daemon=True)
        self.process.start()
        theirs.close()

    def answer(self) -> Any:
        """The child's next answer; AssertionError when it failed or exited instead."""
        wait([self._conn, self.process.sentinel])
        if self._conn.poll():  # an answer, also when the child exited right after sending it
            try:
                kind, value = self._conn.recv()
            except EOFError:
                kind, value = "exit", None
            if kind == "error":
                raise AssertionError(f"child {self.process.name} failed: {value}")
            if kind != "exit":
                return value
        self.process.join()
        raise AssertionError(f"child {self.process.name} exited with code {self.process.exitcode} before answering")

    def wait_for(self, fetch: Callable[[], T | None]) -> T:
        """``fetch()``'s first result that is not None (call it with a short blocking get), while the child works on.

        AssertionError as soon as the child answers (it failed, or it stopped waiting for its
        part) or exits, instead of waiting on for something it will not send.
        """
        while (found := fetch()) is None:
            if self._conn.poll(0) or not self.process.is_alive():
                self.answer()  # raises with the child's error, or returns its early answer
                raise AssertionError(f"child {self.process.name} answered before its part arrived")
        return found

    def finish(self) -> Any:
        """Tell the child it is done and return its report, once it exited with code 0."""
        self._conn.send(DONE)
        report = self.answer()
        self.process.join()
        assert self.process.exitcode == 0, f"child {self.process.name} exited with code {self.process.exitcode}"
        return report

    def close(self) -> None:
        """Let go of the child (it sees the pipe close and exits) and wait for it to exit."""
        self._conn.close()
        self.process.join()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _in_environment(environ: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """In a child: take the parent's environment ``environ``, then run ``target(*args)``."""
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def held_until_done(conn: Connection) -> bool:
    """In a child: block until the parent says :data:`DONE` (True) or goes away (False)."""
    try:
        return bool(conn.recv() == DONE)
    except EOFError:
        return False


def _drained(connectors: list[Any], conn: Connection) -> bool:
    """In a producer child: wait until no connector stages a payload (a reader's one-way "finish"
    may still be on its way); False when the parent went away first."""
    while any(c.health().get("staged", 0) for c in connectors):
        if conn.poll(_DRAIN_POLL):  # the parent sends nothing more before the report: this is its end of file
            return False
    return True


def _fail(conn: Connection, exc: BaseException) -> None:
    try:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except OSError:  # the parent is gone
        pass


# -- payloads -------------------------------------------------------------------------------------------------


def big_payload(seed: int) -> dict[str, Any]:
    """A :data:`BIG`-byte tensor of seeded random bytes and its seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"blob": torch.randint(0, 256, (BIG,), dtype=torch.uint8, generator=g), "meta": {"seed": seed}}


def digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(payload["blob"].numpy().tobytes()).hexdigest()


def small_payload(key: str) -> dict[str, Any]:
    import torch

    return {"v": torch.arange(1000), "key": key}


# -- children ---------------------------------------------------------------------------------------------------


def produce(specs: dict[str, dict[str, Any]], key: str, seed: int, conn: Connection) -> None:
    """Put one :func:`big_payload` through each connector in ``specs`` (name -> config).

    Ready: the connectors' addresses (by name; None without one) and the payload's digest. Report,
    once every reader's "finish" arrived: each connector's health.
    """
    from omni_plugins_mooncake.testing import loopback_environment

    loopback_environment()
    from omni_plugins import create_connector

    try:
        conns = {name: create_connector(name, config) for name, config in specs.items()}
    except Exception as exc:
        _fail(conn, exc)
        raise
    try:
        payload = big_payload(seed)
        for connector in conns.values():
            assert connector.put(0, 1, key, payload).ok
        conn.send(("ready", ({name: getattr(c, "address", None) for name, c in conns.items()}, digest(payload))))
        del payload
        if held_until_done(conn) and _drained(list(conns.values()), conn):
            conn.send(("report", {name: c.health() for name, c in conns.items()}))
    except Exception as exc:
        _fail(conn, exc)
        raise
    finally:
        for connector in conns.values():
            connector.close()


def produce_small(config: dict[str, Any], key: str, conn: Connection) -> None:
    """A ``mooncake-te`` producer holding one :func:`small_payload` under ``key``.

    Ready: its control address. Report, once the reader's "finish" arrived: its health and its
    config's texts (``repr``, ``str``, JSON).
    """
    from omni_plugins_mooncake.testing import loopback_environment

    loopback_environment()
    from omni_plugins import create_connector

    try:
        te = create_connector("mooncake-te", config)
    except Exception as exc:
        _fail(conn, exc)
        raise
    try:
        assert te.put(0, 1, key, small_payload(key)).ok
        conn.send(("ready", te.address))  # type: ignore[attr-defined]
        if held_until_done(conn) and _drained([te], conn):
            settings = te.config  # type: ignore[attr-defined]
            conn.send(("report", {"health": te.health(), "texts": [repr(settings), str(settings), settings.model_dump_json()]}))
    except Exception as exc:
        _fail(conn, exc)
        raise
    finally:
        te.close()


def echo_store(config: dict[str, Any], prefix: str, n: int, conn: Connection) -> None:
    """A ``mooncake-store`` stage that consumes and produces on one instance: ``n`` times it gets
    ``{prefix}{i}`` (waiting in ``get`` before the parent puts it) and puts what it read back as
    ``{prefix}{i}r``. Ready: its segment's name. Report: its health.
    """
    from omni_plugins_mooncake.testing import loopback_environment

    loopback_environment()
    from omni_plugins import create_connector

    try:
        store = create_connector("mooncake-store", config)
    except Exception as exc:
        _fail(conn, exc)
        raise
    try:
        conn.send(("ready", store.health()["segment"]))
        for i in range(n):
            got = _get_while_the_parent_waits(store, f"{prefix}{i}", conn)
            if got is None:
                return
            assert store.put(1, 0, f"{prefix}{i}r", got.data).ok
            del got
        if held_until_done(conn):
            conn.send(("report", store.health()))
    except Exception as exc:
        _fail(conn, exc)
        raise
    finally:
        store.close()


def _get_while_the_parent_waits(connector: Any, key: str, conn: Connection) -> Any:
    """``key``'s payload once it arrives; None when the parent went away first (it sends nothing meanwhile)."""
    while (got := connector.get(0, 1, key, timeout=_GET_SLICE)) is None:
        if conn.poll(0):
            return None
    return got
