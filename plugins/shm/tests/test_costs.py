"""Bookkeeping that must stay O(1) per operation: pool probes per put, name maps per wait_any.

Counted, not timed: ``Segment.looks_free`` calls (one per pool probe) and ``_key`` lookups.
"""

from __future__ import annotations

import gc as pygc
import random
from typing import Any

import pytest
import torch
from omni_plugins_shm.segments import pool as pool_mod
from omni_plugins_shm.testing import make_payload, payload_matches


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-element list counting ``looks_free`` calls."""
    count = [0]
    orig = pool_mod.Segment.looks_free

    def counted(seg: pool_mod.Segment) -> bool:
        count[0] += 1
        return orig(seg)

    monkeypatch.setattr(pool_mod.Segment, "looks_free", counted)
    return count


def _small() -> dict[str, Any]:
    return {"t": torch.arange(256, dtype=torch.int32)}


def test_put_with_many_unconsumed_payloads_probes_a_bounded_number(pair: Any, probes: list[int]) -> None:
    producer, consumer = pair
    for i in range(300):
        producer.put(0, 1, f"held{i}", _small())
    probes[0] = 0
    for i in range(40):  # ping-pong next to 300 outstanding segments of the same class
        producer.put(0, 1, f"x{i}", _small())
        assert consumer.get(0, 1, f"x{i}") is not None
    assert probes[0] <= 40 * (pool_mod.PROBES + 2)  # the old scan made 300+ probes per put
    # and the returned segment is what the ping-pong reuses: the pool grew by one segment at most
    assert producer.health()["pooled_segments"] <= 301
    for i in range(300):
        got = consumer.get(0, 1, f"held{i}")
        assert got is not None and torch.equal(got.data["t"], _small()["t"])


def test_out_of_order_returns_are_all_reused_within_a_round(pair: Any, probes: list[int]) -> None:
    producer, consumer = pair
    rng = random.Random(3)
    for r in range(20):
        keys = [f"r{r}-{i}" for i in range(64)]
        for k in keys:
            producer.put(0, 1, k, make_payload(r, 2048))
        rng.shuffle(keys)
        for k in keys:
            got = consumer.get(0, 1, k)
            assert got is not None and payload_matches(got.data, r, 2048)
    # 64 in flight, any return order: the pool stays near 64 segments, at most a few probes per put
    assert producer.health()["pooled_segments"] <= 64 + 64 // pool_mod.PROBES
    assert probes[0] <= 20 * 64 * (pool_mod.PROBES + 2)


def test_pool_stops_growing_next_to_unclaimed_payloads(pair: Any, probes: list[int]) -> None:
    """Bursts of 50 puts then 50 shuffled gets next to 300 payloads nobody takes: the held ones move
    out of the hot probe path and the bursts recycle their own segments."""
    producer, consumer = pair
    for i in range(300):
        producer.put(0, 1, f"held{i}", _small())
    rng = random.Random(5)
    sizes = []
    for r in range(12):
        keys = [f"b{r}-{i}" for i in range(50)]
        for k in keys:
            producer.put(0, 1, k, _small())
        rng.shuffle(keys)
        for k in keys:
            assert consumer.get(0, 1, k) is not None
        sizes.append(producer.health()["pooled_segments"])
    assert sizes[-1] == sizes[len(sizes) // 2]  # steady state: no new segments per burst
    assert probes[0] <= 12 * 50 * (pool_mod.PROBES + 2)
    for i in range(300):
        assert producer.cleanup(f"held{i}")


def test_a_segment_held_by_views_is_never_reused(pair: Any) -> None:
    producer, consumer = pair
    producer.put(0, 1, "v", {"t": torch.full((512,), 7, dtype=torch.int32)})
    held = consumer.get_views(0, 1, "v")
    assert held is not None
    for i in range(50):  # every put probes; none may land in the segment the views read
        producer.put(0, 1, f"o{i}", {"t": torch.full((512,), i, dtype=torch.int32)})
        got = consumer.get(0, 1, f"o{i}")
        assert got is not None and int(got.data["t"][0]) == i
        assert bool((held.data["t"] == 7).all())
    del held, got
    pygc.collect()
    producer.put(0, 1, "after", _small())  # the freed segment comes back without leaking
    assert consumer.get(0, 1, "after") is not None


def test_repeat_wait_any_on_the_same_keys_builds_no_name_map(file_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    producer, consumer = file_pair
    keys = [f"w{i}" for i in range(64)]
    producer.put(0, 1, keys[9], _small())
    lookups = [0]
    orig = consumer._key

    def counted(key: str) -> Any:
        lookups[0] += 1
        return orig(key)

    monkeypatch.setattr(consumer, "_key", counted)
    assert consumer.wait_any(keys, 0.0) == [keys[9]]
    assert lookups[0] == 64
    assert consumer.wait_any(list(keys), 0.0) == [keys[9]]  # an equal set in a new list: no per-key work
    assert consumer.wait_any(tuple(keys), 0.0) == [keys[9]]
    assert lookups[0] == 64
    other = keys[:10]
    assert consumer.wait_any(other, 0.0) == [keys[9]]  # a different set is rebuilt
    assert lookups[0] == 74
    assert consumer.get(0, 1, keys[9]) is not None
    assert consumer.wait_any(other, 0.0) == []  # the cache is names, never presence
