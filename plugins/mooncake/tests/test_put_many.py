"""``put_many`` on the Mooncake store (a real ``mooncake_master``): one encode, one batch call per path, each key its own object."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch
from omni_plugins_mooncake import store as store_mod
from omni_plugins_mooncake.testing import MooncakeMaster

from omni_plugins import create_connector

from .conftest import store_config


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the payloads encoded in this process (``omni_plugins.wire.encode``, which both connectors call)."""
    seen = [0]
    real = store_mod.wire.encode

    def encode(data: Any) -> Any:
        seen[0] += 1
        return real(data)

    monkeypatch.setattr(store_mod.wire, "encode", encode)
    return seen


@pytest.mark.parametrize("elements", [1000, 5 << 18], ids=["4KB-slab", "5MiB-direct"])
def test_every_key_gets_the_payload_from_one_encode(master: MooncakeMaster, encodes: list[int], elements: int) -> None:
    """A key the store already has takes the slab path (upsert replaces it); the new ones take the path of their size."""
    tag = uuid.uuid4().hex[:8]
    old, *new = keys = [f"pm-{tag}-{i}" for i in range(3)]
    payload = {"v": torch.arange(elements, dtype=torch.float32)}
    with (
        create_connector("mooncake-store", store_config(master)) as producer,
        create_connector("mooncake-store", store_config(master, global_segment_size=0)) as consumer,
    ):
        assert producer.put(0, 1, old, {"v": torch.zeros(3)}).ok
        before = producer.health()["direct_puts"]
        encodes[0] = 0
        results = producer.put_many([(0, i + 1, k) for i, k in enumerate(keys)], payload)
        assert all(r.ok for r in results) and len({r.size for r in results}) == 1
        assert encodes[0] == 1
        assert producer.health()["direct_puts"] - before == (len(new) if elements * 4 >= store_mod.DIRECT_MIN else 0)
        payload["v"].fill_(-1.0)  # the objects hold what was there at put_many
        for i, key in enumerate(keys):
            got = consumer.get(0, i + 1, key, timeout=10)
            assert got is not None and torch.equal(got.data["v"], torch.arange(elements, dtype=torch.float32))
            assert consumer.get(0, i + 1, key) is None
        health = producer.health()
        assert health["puts"] == 4 and health["bytes_put"] >= 3 * results[0].size


TE = "mooncake-te"


def test_te_stages_one_slab_under_every_key_and_frees_it_after_the_last(encodes: list[int]) -> None:
    """Real engines over loopback: two keys read by another instance, one taken locally, one left to cleanup."""
    payload = {"v": torch.arange(300_000, dtype=torch.float32)}  # 1.2 MB
    keys = [f"te-{i}" for i in range(4)]
    with create_connector(TE, {"pool_size": "128MiB"}) as producer:
        one = producer.put(0, 1, "alone", payload)  # the slab one put of this payload takes
        slab_bytes = producer.health()["staging_pool"]["in_use_bytes"]
        assert producer.get(0, 1, "alone") is not None and one.ok
        encodes[0] = 0
        results = producer.put_many([(0, i + 1, k) for i, k in enumerate(keys)], payload)
        assert all(r.ok for r in results) and encodes[0] == 1
        health = producer.health()
        assert health["staged"] == 4 and health["staging_pool"]["in_use_bytes"] == slab_bytes  # one slab for all four
        with create_connector(TE, {"listen_address": None, "peers": [producer.address]}) as consumer:  # type: ignore[attr-defined]
            for stage, key in ((1, keys[0]), (2, keys[1])):
                got = consumer.get(0, stage, key, timeout=5)
                assert got is not None and torch.equal(got.data["v"], payload["v"])
            local = producer.get(0, 3, keys[2])
            assert local is not None and torch.equal(local.data["v"], payload["v"])
            assert producer.cleanup(keys[3]) is True
            for _ in range(200):  # the remote readers' one-way finish reaches the producer shortly
                if producer.health()["staged"] == 0:
                    break
                time.sleep(0.02)
            assert producer.health()["staged"] == 0
            assert producer.health()["staging_pool"]["in_use_bytes"] == slab_bytes  # the local reader's tensors still hold it
            del local
            assert producer.health()["staging_pool"]["in_use_bytes"] == 0
