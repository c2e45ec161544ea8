"""``mooncake-store`` against a real ``mooncake_master``: failure modes and a 64 MiB cross-process move."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psutil
import pytest
import torch
from omni_plugins_mooncake.testing import MooncakeMaster, free_port

from omni_plugins import create_connector
from omni_plugins.errors import ConnectorError

from .conftest import store_config


def test_master_listens_on_loopback_only(master: MooncakeMaster) -> None:
    assert master.pid is not None
    listening = [c.laddr for c in psutil.Process(master.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening, "the master listens nowhere?"
    assert {addr.ip for addr in listening} == {"127.0.0.1"}, listening
    assert master.rpc_port in {addr.port for addr in listening}


def test_missing_master_fails_fast_with_its_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConnectorError, match=f"master at {address} is not reachable"):
        create_connector("mooncake-store", {"master_address": address, "connect_timeout": 1.0})


def test_put_overwrites_and_get_consumes(master: MooncakeMaster) -> None:
    key = f"ow-{uuid.uuid4().hex}"
    with create_connector("mooncake-store", store_config(master)) as conn:
        assert conn.put(0, 1, key, {"v": torch.zeros(4)}).ok
        assert conn.put(0, 1, key, {"v": torch.ones(4)}).ok  # raw store put would keep the zeros
        got = conn.get(0, 1, key)
        assert got is not None and torch.equal(got.data["v"], torch.ones(4))
        assert conn.get(0, 1, key) is None
        # sizes that grow past the last one read (the connector guesses the size) and shrink again
        for n in (3 << 20, 17 << 20, 100):
            conn.put(0, 1, key, {"v": torch.full((n,), n % 251, dtype=torch.uint8)})
            got = conn.get(0, 1, key)
            assert got is not None and torch.equal(got.data["v"], torch.full((n,), n % 251, dtype=torch.uint8))
        health = conn.health()
        assert health["ok"] is True and health["master"] == master.address


def test_received_tensors_outlive_later_gets(master: MooncakeMaster) -> None:
    """Zero-copy gets must not hand out memory that the next get overwrites."""
    with create_connector("mooncake-store", store_config(master)) as conn:
        keys = [f"zc-{i}-{uuid.uuid4().hex}" for i in range(3)]
        for i, key in enumerate(keys):
            conn.put(0, 1, key, {"v": torch.full((1000,), float(i))})
        got = [conn.get(0, 1, k) for k in keys]
        for i, g in enumerate(got):
            assert g is not None and torch.equal(g.data["v"], torch.full((1000,), float(i)))
        del got, g
        assert conn.health()["buffers"]["in_use_bytes"] == 0  # leases came back


def test_consumed_object_is_removed_in_the_background(master: MooncakeMaster) -> None:
    """``get`` leaves the forced remove to a background thread; the object still goes, and a re-put survives it."""
    key = f"bg-{uuid.uuid4().hex}"
    with (
        create_connector("mooncake-store", store_config(master)) as producer,
        create_connector("mooncake-store", store_config(master, global_segment_size=0)) as consumer,
    ):
        for round_ in range(20):  # consume then immediately re-put the same key, from the consuming instance too
            assert producer.put(0, 1, key, {"v": torch.full((64,), round_)}).ok
            got = consumer.get(0, 1, key, timeout=5)
            assert got is not None and int(got.data["v"][0]) == round_
            assert consumer.get(0, 1, key) is None  # consumed, even while its removal may still be queued
            assert consumer.put(0, 1, key, {"v": torch.full((64,), -round_)}).ok  # settles the pending removal first
            again = producer.get(0, 1, key, timeout=5)
            assert again is not None and int(again.data["v"][0]) == -round_
        deadline = time.monotonic() + 10
        while (producer.health()["pending_removals"] or consumer.health()["pending_removals"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert producer.health()["pending_removals"] == 0 and consumer.health()["pending_removals"] == 0
        assert producer.health()["remove_failures"] == 0 and consumer.health()["remove_failures"] == 0
        assert producer.get(0, 1, key) is None and consumer.get(0, 1, key) is None


class _RecordedReads:
    """Around the real store client: ``get_into``'s return codes are recorded; ``seen`` is set by the first of ``code``."""

    def __init__(self, store: Any, code: int) -> None:
        self._store, self._code = store, code
        self.codes: list[int] = []
        self.seen = threading.Event()

    def get_into(self, key: str, address: int, capacity: int) -> int:
        got = int(self._store.get_into(key, address, capacity))
        self.codes.append(got)
        if got == self._code:
            self.seen.set()
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_get_that_meets_the_put_of_its_key_under_way_waits_for_it(master: MooncakeMaster) -> None:
    """The master knows a key from the start of its put and serves it from the put's end; a read in between
    is answered "replica not ready". That is a payload not there yet: ``None``, and a blocking get waits on."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from omni_plugins_mooncake.errors import REPLICA_IS_NOT_READY

    key = f"underway-{uuid.uuid4().hex}"
    writer = MooncakeDistributedStore()  # a put held open between its start and its end
    assert writer.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master.address) == 0
    with (
        create_connector("mooncake-store", store_config(master)) as producer,
        create_connector("mooncake-store", store_config(master, global_segment_size=0)) as consumer,
    ):
        try:
            assert writer.batch_put_session_start([key], [4096], ReplicateConfig()) == [0]
            reads = _RecordedReads(consumer._store, REPLICA_IS_NOT_READY)  # type: ignore[attr-defined]
            consumer._store = reads  # type: ignore[attr-defined]
            assert consumer.get(0, 1, key) is None
            assert reads.codes == [REPLICA_IS_NOT_READY]
            reads.seen.clear()
            waiting: list[Any] = []
            getter = threading.Thread(target=lambda: waiting.append(consumer.get(0, 1, key, timeout=120)))
            getter.start()
            assert reads.seen.wait(120), "the blocking get never read"  # it met the put under way at least once
        finally:
            assert writer.batch_put_session_revoke([key]) == [0]
            writer.close()
        assert producer.put(0, 1, key, {"v": torch.arange(16)}).ok  # the put that gets through
        getter.join()
        (got,) = waiting
        assert got is not None and torch.equal(got.data["v"], torch.arange(16))


def test_master_key_count_counts_objects_without_removing_them(own_master: MooncakeMaster) -> None:
    """``MooncakeMaster.key_count`` (the soak's leak check) sees live objects and leaves them in place."""
    assert own_master.key_count() == 0
    with create_connector("mooncake-store", store_config(own_master)) as conn:
        for i in range(3):
            assert conn.put(0, 1, f"kc-{i}", {"v": [i]}).ok
        assert own_master.key_count() == 3
        assert own_master.key_count() == 3  # counting removed nothing
        for i in range(3):
            got = conn.get(0, 1, f"kc-{i}", timeout=5)
            assert got is not None and got.data["v"] == [i]
        assert own_master.settled_key_count(10) == 0  # consumed objects go in the background


def _retry(fn: Any, attempts: int = 150) -> Any:
    last: Exception | None = None
    for _ in range(attempts):
        try:
            return fn()
        except ConnectorError as exc:
            last = exc
            time.sleep(0.2)
    raise AssertionError(f"no recovery: {last}")


def test_master_killed_mid_run_errors_then_recovers(own_master: MooncakeMaster) -> None:
    conn = create_connector("mooncake-store", store_config(own_master))
    try:
        assert conn.put(0, 1, "before", {"v": torch.arange(3)}).ok
        own_master.kill()
        with pytest.raises(ConnectorError, match=own_master.address):
            conn.put(0, 1, "during", {"v": torch.arange(3)})
        with pytest.raises(ConnectorError, match=own_master.address):
            conn.get(0, 1, "before")
        own_master.restart()
        # the client re-registers with the new master by itself; no new connector needed
        assert _retry(lambda: conn.put(0, 1, "after", {"v": torch.arange(5)})).ok
        got = conn.get(0, 1, "after", timeout=10)
        assert got is not None and torch.equal(got.data["v"], torch.arange(5))
        assert conn.get(0, 1, "before") is None  # a restarted master has forgotten old objects
    finally:
        conn.close()


def _large(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randint(0, 256, (5 << 20,), dtype=torch.uint8, generator=g), "y": torch.arange(3), "s": "text", "z": torch.ones(7)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("x", "y", "z")) and a["s"] == b["s"]


def test_large_new_key_skips_the_staging_copy_and_keeps_copy_semantics(master: MooncakeMaster) -> None:
    key = f"direct-{uuid.uuid4().hex}"
    with create_connector("mooncake-store", store_config(master)) as conn:
        payload = _large(1)
        expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in payload.items()}
        assert conn.put(0, 1, key, payload).ok
        payload["x"].fill_(0)  # the caller may reuse its memory once put returns
        assert conn.health()["direct_puts"] == 1
        assert len(conn._direct.registrations) == 0  # type: ignore[attr-defined]
        got = conn.get(0, 1, key)
        assert got is not None and _same(got.data, expected)


def test_large_reput_of_an_existing_key_replaces_it(master: MooncakeMaster) -> None:
    """The direct path is a plain put (it would keep the old value), so an existing key goes through upsert."""
    key = f"direct-ow-{uuid.uuid4().hex}"
    with create_connector("mooncake-store", store_config(master)) as conn:
        assert conn.put(0, 1, key, _large(1)).ok
        assert conn.put(0, 1, key, _large(2)).ok
        assert conn.health()["direct_puts"] == 1
        got = conn.get(0, 1, key)
        assert got is not None and _same(got.data, _large(2))


def test_memory_that_cannot_be_registered_falls_back_to_the_slab(master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch) -> None:
    key = f"direct-fb-{uuid.uuid4().hex}"
    with create_connector("mooncake-store", store_config(master)) as conn:
        monkeypatch.setattr(conn._direct.registrations, "acquire", lambda ranges: False)  # type: ignore[attr-defined]
        assert conn.put(0, 1, key, _large(3)).ok
        assert conn.health()["direct_puts"] == 0
        got = conn.get(0, 1, key)
        assert got is not None and _same(got.data, _large(3))


class _SilentReads:
    """Fault injection around the real store client: ``get_into`` reports the object's size but writes nothing."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.silent = False

    def get_into(self, key: str, address: int, capacity: int) -> int:
        if self.silent:
            return int(self._store.get_size(key))
        return int(self._store.get_into(key, address, capacity))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_read_that_writes_nothing_is_an_error_not_the_slabs_last_payload(master: MooncakeMaster) -> None:
    """A reused slab still holds the last message read into it; a read that leaves it untouched must not decode as that."""
    from omni_plugins.errors import WireFormatError

    with create_connector("mooncake-store", store_config(master)) as conn:
        first, second = f"sr1-{uuid.uuid4().hex}", f"sr2-{uuid.uuid4().hex}"
        assert conn.put(0, 1, first, {"who": "first", "v": torch.arange(8)}).ok
        assert conn.put(0, 1, second, {"who": "second", "v": torch.arange(8) * 2}).ok
        got = conn.get(0, 1, first)
        assert got is not None and got.data["who"] == "first"
        del got  # its slab goes back to the pool, still holding the first message
        faulty = _SilentReads(conn._store)  # type: ignore[attr-defined]
        conn._store = faulty  # type: ignore[attr-defined]
        faulty.silent = True
        with pytest.raises(WireFormatError):
            conn.get(0, 1, second)
        faulty.silent = False
        assert conn.cleanup(second) in (True, False)  # whatever the failed read left, the key goes


class _ExpiringReads:
    """Fault injection around the real store client: the first ``n`` reads outlive the master's lease."""

    def __init__(self, store: Any, n: int) -> None:
        self._store, self.n, self.reads = store, n, 0

    def get_into(self, key: str, address: int, capacity: int) -> int:
        from omni_plugins_mooncake.errors import LEASE_EXPIRED

        self.reads += 1
        return LEASE_EXPIRED if self.reads <= self.n else int(self._store.get_into(key, address, capacity))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_reads_that_outlive_the_lease_are_retried_until_the_gets_timeout(master: MooncakeMaster) -> None:
    """A slow network can make every read outlive a short lease: a get with a timeout keeps reading until it ends."""
    from omni_plugins_mooncake import store as store_module

    with create_connector("mooncake-store", store_config(master)) as conn:
        key = f"lease-{uuid.uuid4().hex}"
        assert conn.put(0, 1, key, {"v": torch.arange(1000)}).ok  # fits the first read's slab: one read per attempt
        real = conn._store  # type: ignore[attr-defined]
        conn._store = expiring = _ExpiringReads(real, n=10)  # type: ignore[attr-defined]
        with pytest.raises(ConnectorError, match="lease expired"):
            conn.get(0, 1, key)  # no timeout: one read and its few retries, then a typed error
        assert expiring.reads == 1 + store_module._READ_ATTEMPTS
        got = conn.get(0, 1, key, timeout=30.0)  # the rest of the 10 expire, then the read succeeds, well within 30 s
        assert got is not None and torch.equal(got.data["v"], torch.arange(1000))
        assert expiring.reads == 11
        conn._store = real  # type: ignore[attr-defined]
