"""The optional ``wait_any_sets`` capability: which shape of keys a connector's wait primitives are handed."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from omni_plugins.contract import Capabilities
from omni_plugins.memory import MemoryConnector


class _Recording(MemoryConnector):
    """A memory connector that records what its wait primitives were handed and reports the first key."""

    def __init__(self, sets: bool) -> None:
        super().__init__()
        self.capabilities = Capabilities(wait_any=True, poll_any=True, wait_any_sets=sets)
        self.handed: list[Collection[str]] = []

    def _wait_any(self, keys: Collection[str], timeout: float) -> list[str]:
        self.handed.append(keys)
        return sorted(keys)[:1]

    def _poll_any(self, keys: Collection[str], timeout: float) -> list[str]:
        return self._wait_any(keys, timeout)


@pytest.mark.parametrize("call", ["wait_any", "poll_any"])
def test_without_the_capability_a_set_or_keys_view_reaches_the_connector_as_a_list(call: str) -> None:
    conn = _Recording(sets=False)
    pending = dict.fromkeys(["b", "a"])
    assert getattr(conn, call)(pending.keys(), 0.0) == ["a"]
    assert getattr(conn, call)({"c", "d"}, 0.0) == ["c"]
    assert all(type(k) is list for k in conn.handed)
    assert sorted(conn.handed[0]) == ["a", "b"]


def test_with_the_capability_the_collection_is_handed_over_as_it_is() -> None:
    conn = _Recording(sets=True)
    pending = dict.fromkeys(["b", "a"])
    view = pending.keys()
    assert conn.wait_any(view, 0.0) == ["a"]
    assert conn.handed[0] is view
    assert conn.wait_any(set(), 0.0) == [] and len(conn.handed) == 1  # nothing to wait on: no call
