"""The in-process reference connector passes the conformance kit."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

import pytest

from omni_plugins.testing import ConnectorContract, ServicesContract


class TestMemoryConnector(ConnectorContract):
    cross_process = False
    bad_config: ClassVar[dict[str, Any]] = {"max_bytes": -1}

    @pytest.fixture
    def connector_spec(self) -> tuple[str, dict[str, Any]]:
        return "memory", {"namespace": f"contract-{uuid.uuid4().hex}"}


def test_memory_close_frees_what_it_owns() -> None:
    from omni_plugins import create_connector

    ns = {"namespace": f"own-{uuid.uuid4().hex}"}
    producer, consumer = create_connector("memory", ns), create_connector("memory", ns)
    assert producer.put(0, 1, "a", {"x": 1}).ok
    assert consumer.health()["keys"] == 1
    producer.close()
    assert consumer.health()["keys"] == 0
    consumer.close()


def test_memory_keeps_nothing_of_payloads_another_instance_read() -> None:
    """A producer's bookkeeping of what it put ends with the payload: a long run does not grow it."""
    from omni_plugins import create_connector

    ns = {"namespace": f"read-{uuid.uuid4().hex}"}
    producer, consumer = create_connector("memory", ns), create_connector("memory", ns)
    for i in range(100):
        assert producer.put(0, 1, f"k{i}", {"x": i}).ok
        assert consumer.get(0, 1, f"k{i}") is not None
    assert producer.put(0, 1, "unread", {"x": 0}).ok
    store = type(producer)._stores[ns["namespace"]]
    assert list(store.owners) == ["unread"]
    producer.close()
    assert store.owners == {} and store.items == {}
    consumer.close()


def test_memory_refuses_puts_over_its_budget() -> None:
    from omni_plugins import create_connector

    with create_connector("memory", {"namespace": f"b-{uuid.uuid4().hex}", "max_bytes": 64}) as conn:
        res = conn.put(0, 1, "big", {"x": b"x" * 1000})
        assert res.ok is False and "full" in (res.metadata or {}).get("error", "")
        assert conn.get(0, 1, "big") is None


class TestMemoryServices(ServicesContract):
    """The built-in connector's services go through the same kit as every plugin's."""

    leftover = "open"

    @pytest.fixture
    def connector_spec(self) -> tuple[str, dict[str, Any]]:
        return "memory", {"namespace": f"services-{uuid.uuid4().hex}"}
