"""``mooncake-te`` with real TransferEngines over loopback TCP: roles, failures, a 64 MiB cross-process move."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omni_plugins import create_connector
from omni_plugins.contract import Connector
from omni_plugins.errors import ConnectorError

TE = "mooncake-te"


@pytest.fixture
def producer() -> Iterator[Connector]:
    with create_connector(TE, {"pool_size": "128MiB"}) as conn:
        yield conn


def consumer_of(*peers: Connector | str, **extra: Any) -> Connector:
    addresses = [p if isinstance(p, str) else p.address for p in peers]  # type: ignore[attr-defined]
    return create_connector(TE, {"listen_address": None, "peers": addresses, **extra})


def _wait_for(predicate: Any, what: str, attempts: int = 200) -> None:
    for _ in range(attempts):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def test_remote_get_consumes_and_frees_the_producer_slab(producer: Connector) -> None:
    with consumer_of(producer) as consumer:
        assert producer.put(0, 1, "k", {"v": torch.arange(100)}).ok
        assert producer.health()["staged"] == 1
        got = consumer.get(0, 1, "k", timeout=5)
        assert got is not None and torch.equal(got.data["v"], torch.arange(100))
        assert consumer.get(0, 1, "k") is None  # consumed at once, even before the producer frees it
        # the reader's "finish" is one-way: the producer frees the slab when it arrives
        _wait_for(lambda: producer.health()["staged"] == 0, "producer freed the consumed payload")
        health = producer.health()
        assert health["being_read"] == 0 and health["staging_pool"]["in_use_bytes"] == 0


def test_one_instance_both_receives_and_sends(producer: Connector) -> None:
    """Stage 1 reads from stage 0 and serves stage 2: listen address plus peers in one config."""
    middle = create_connector(TE, {"peers": [producer.address]})  # type: ignore[attr-defined]
    last = consumer_of(middle)
    try:
        producer.put(0, 1, "req_0_0", {"h": torch.ones(8)})
        got = middle.get(0, 1, "req_0_0", timeout=5)
        assert got is not None
        middle.put(1, 2, "req_1_0", {"h": got.data["h"] * 2})
        out = last.get(1, 2, "req_1_0", timeout=5)
        assert out is not None and torch.equal(out.data["h"], torch.full((8,), 2.0))
    finally:
        last.close()
        middle.close()


def test_consumer_cleanup_frees_the_producer_copy(producer: Connector) -> None:
    with consumer_of(producer) as consumer:
        producer.put(0, 1, "gone", {"v": torch.arange(3)})
        assert consumer.cleanup("gone") is True
        assert producer.health()["staged"] == 0
        assert consumer.get(0, 1, "gone") is None


def test_unconsumed_payload_is_reclaimed_after_ttl() -> None:
    with create_connector(TE, {"payload_ttl": 0.2}) as producer, consumer_of(producer) as consumer:
        producer.put(0, 1, "old", {"v": torch.arange(3)})
        _wait_for(lambda: producer.health()["staged"] == 0, "TTL reclaim")
        assert producer.health()["reclaimed_by_ttl"] == 1
        assert consumer.get(0, 1, "old") is None


def test_dead_peer_is_an_error_not_a_hang() -> None:
    producer = create_connector(TE, {})
    address = producer.address  # type: ignore[attr-defined]
    producer.close()
    with consumer_of(address, socket_timeout=1.0) as consumer:
        with pytest.raises(ConnectorError, match=f"peer {address} is unreachable"):
            consumer.get(0, 1, "k", timeout=2)
        assert consumer.health()["ok"] is False


def test_producer_dying_after_a_claim_makes_the_read_fail() -> None:
    """The claim answer points at memory that vanishes with its process: the read must fail cleanly."""
    producer = create_connector(TE, {})
    consumer = consumer_of(producer, socket_timeout=1.0)
    try:
        producer.put(0, 1, "k", {"v": torch.arange(10)})
        from omni_plugins_mooncake.te.control import ControlClient

        reply = ControlClient(producer.address, timeout=1).request({"op": "claim", "key": "k"})  # type: ignore[attr-defined]
        assert reply["found"] is True
        producer.close()
        with pytest.raises(ConnectorError):
            consumer.get(0, 1, "k", timeout=1)
    finally:
        consumer.close()


def test_consume_only_instance_cannot_put() -> None:
    with create_connector(TE, {"listen_address": None}) as conn, pytest.raises(ConnectorError, match="no listen_address"):
        conn.put(0, 1, "k", {"v": 1})


def test_full_staging_pool_is_a_clear_error() -> None:
    with create_connector(TE, {"pool_size": "2MiB"}) as conn:
        assert conn.put(0, 1, "a", {"v": torch.zeros(1 << 18)}).ok  # 1 MiB
        with pytest.raises(ConnectorError, match="registered memory exhausted"):
            conn.put(0, 1, "b", {"v": torch.zeros(1 << 19)})  # 2 MiB more
        assert conn.get(0, 1, "a") is not None  # the earlier payload is intact


def test_short_claim_timeout_uses_acknowledged_finish() -> None:
    """With little claim time left the reader must ask whether its claim held (no one-way finish)."""
    with create_connector(TE, {"claim_timeout": 0.5}) as producer, consumer_of(producer) as consumer:
        producer.put(0, 1, "k", {"v": torch.arange(7)})
        got = consumer.get(0, 1, "k", timeout=5)
        assert got is not None and torch.equal(got.data["v"], torch.arange(7))
        assert producer.health()["staged"] == 0


def test_read_past_its_deadline_strands_the_buffer_and_returns_the_claim(producer: Connector) -> None:
    """A read that may still land later must never have its buffer reused; the payload stays available."""
    from omni_plugins_mooncake.te.transfer import TIMED_OUT

    class _TimesOut:
        def read(self, *args: object) -> int:
            return TIMED_OUT

    with consumer_of(producer) as consumer:
        producer.put(0, 1, "k", {"v": torch.arange(10)})
        reader = consumer._reader  # type: ignore[attr-defined]
        consumer._reader = _TimesOut()  # type: ignore[attr-defined]
        with pytest.raises(ConnectorError, match="did not complete"):
            consumer.get(0, 1, "k")
        health = consumer.health()
        assert health["stranded_receive_buffers"] == 1
        assert health["receive_buffers"]["in_use_bytes"] > 0  # not back in the pool
        stranded = consumer._stranded[0]  # type: ignore[attr-defined]
        consumer._reader = reader  # type: ignore[attr-defined]
        got = consumer.get(0, 1, "k", timeout=5)  # the claim was returned: the payload can be read again
        assert got is not None and torch.equal(got.data["v"], torch.arange(10))
        assert not stranded.address <= got.data["v"].data_ptr() < stranded.address + stranded.size
