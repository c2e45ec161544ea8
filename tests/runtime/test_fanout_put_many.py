"""Fan-out through ``put_many``: the edges of a stage that share a connector get each payload in one call.

In-process memory connectors (the real-backend versions: each plugin's ``test_put_many.py``, and
``tests/cli/test_run_topology.py`` runs the fan-out example across processes over shm and Redis).
What must hold: one ``put_many`` per chunk and connector, the same payload at every destination,
booking per route and key as with one put each (a failed target is retried alone, an abort frees
every route's keys), and a connector without its own ``put_many`` still fans out.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch
from rt_helpers import FAST, FlakyConnector, Req, collect_until

from omni_plugins.config import parse_pipeline_config
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult, failed_put
from omni_plugins.errors import ConnectorContractError, ConnectorError
from omni_plugins.memory import MemoryConfig, MemoryConnector
from omni_plugins.runtime import StageTransferRuntime

PASS = "omni_plugins.testing.builders.passthrough"

FAN_OUT = f"""
connectors:
  c: {{name: memory, extra: {{namespace: c-NS}}}}
stages:
  - {{stage_id: 0, async_chunk: true, custom_process_next_stage_input_func: {PASS}, output_connectors: {{to_stage_1: c, to_stage_2: c}}}}
  - {{stage_id: 1, async_chunk: true, input_connectors: {{from_stage_0: c}}}}
  - {{stage_id: 2, async_chunk: true, input_connectors: {{from_stage_0: c}}}}
"""


class CountingConnector(MemoryConnector):
    """A memory connector that records its puts: ``("put", key)`` and ``("put_many", keys)``; ``refuse``: keys whose
    next ``put_many`` target fails (once each)."""

    def __init__(self, namespace: str) -> None:
        super().__init__(MemoryConfig(namespace=namespace))
        self.calls: list[tuple[str, Any]] = []
        self.refuse: set[str] = set()
        self.lock = threading.Lock()

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        with self.lock:
            self.calls.append(("put", key))
        return super()._put(from_stage, to_stage, key, data)

    def _put_many(self, targets: list[tuple[str, str, str]], data: Any) -> list[PutResult]:
        keys = [k for _, _, k in targets]
        with self.lock:
            self.calls.append(("put_many", keys))
            refused = self.refuse & set(keys)
            self.refuse -= refused
        stored = super()._put_many([t for t in targets if t[2] not in refused], data)
        results = iter(stored)
        return [failed_put(ConnectorError(f"injected: {k}")) if k in refused else next(results) for k in keys]

    def puts_of(self, key: str) -> int:
        with self.lock:
            return sum(1 for kind, keys in self.calls if (key == keys if kind == "put" else key in keys))


class ThirdParty(Connector):
    """A plugin written before ``put_many``: only the primitives (over a memory connector)."""

    capabilities = Capabilities(blocking_get=True, cross_process=False)

    def __init__(self, namespace: str) -> None:
        super().__init__()
        self.inner = MemoryConnector(MemoryConfig(namespace=namespace))
        self.puts: list[str] = []

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        self.puts.append(key)
        return self.inner.put(from_stage, to_stage, key, data)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        return self.inner.get(from_stage, to_stage, key, timeout=timeout)

    def _cleanup(self, key: str) -> bool:
        return self.inner.cleanup(key)

    def _close(self) -> None:
        self.inner.close()


@pytest.fixture
def ns() -> str:
    return uuid.uuid4().hex[:8]


def _runtimes(ns: str, conn: Connector, runtimes: list) -> tuple[StageTransferRuntime, ...]:
    cfg = parse_pipeline_config(FAN_OUT.replace("NS", ns), filename="p.yaml")
    made = (
        StageTransferRuntime.from_pipeline(cfg, 0, tuning=FAST, connectors={"c": conn}, close_connector=False),
        StageTransferRuntime.from_pipeline(cfg, 1, tuning=FAST),
        StageTransferRuntime.from_pipeline(cfg, 2, tuning=FAST),
    )
    runtimes.extend(made)
    return made


def _stream(sender: StageTransferRuntime, receivers: tuple[StageTransferRuntime, ...], steps: int) -> list[dict[str, Any]]:
    for rt in receivers:
        assert rt.register_chunk_recv(Req("r"))
    req = Req("r")
    for step in range(steps):
        req.done = step == steps - 1
        assert sender.send_chunk(req, {"embed": {"decode": torch.full((2, 8), float(step))}, "ids": {"output": [step]}})
    got = []
    for rt in receivers:
        collect_until(rt, lambda sig: "r" in sig.chunk_finished)
        got.append(rt.get_local_stage_payload("r"))
        rt.cleanup_finished_request("r")
    sender.cleanup_finished_request("r")
    return got


def test_one_put_many_per_chunk_and_the_same_payload_everywhere(runtimes: list, ns: str) -> None:
    conn = CountingConnector(f"c-{ns}")
    thinker, talker, detok = _runtimes(ns, conn, runtimes)
    got = _stream(thinker, (talker, detok), 3)
    assert conn.calls == [("put_many", [f"r_0-1_{i}", f"r_0-2_{i}"]) for i in range(3)]
    expected = torch.stack([torch.full((2, 8), float(i)) for i in range(3)])
    for payload in got:
        assert torch.equal(payload["embed"]["decode"].reshape(3, 2, 8), expected) and payload["ids"]["output"] == [0, 1, 2]
    stats = thinker.debug_state()["sender"]
    assert (stats["put_many"], stats["puts"], stats["put_failures"]) == (3, 6, 0)
    assert thinker.debug_state()["requests"] == {} and conn.keys() == []
    conn.close()


def test_a_failed_target_is_retried_alone(runtimes: list, ns: str) -> None:
    conn = CountingConnector(f"c-{ns}")
    conn.refuse = {"r_0-2_0"}
    thinker, talker, detok = _runtimes(ns, conn, runtimes)
    got = _stream(thinker, (talker, detok), 2)
    assert [p["ids"]["output"] for p in got] == [[0, 1], [0, 1]]
    assert conn.calls[0] == ("put_many", ["r_0-1_0", "r_0-2_0"])
    assert ("put", "r_0-2_0") in conn.calls  # the retry: that key alone
    assert {k: conn.puts_of(k) for k in ("r_0-1_0", "r_0-2_0", "r_0-1_1", "r_0-2_1")} == {
        "r_0-1_0": 1,
        "r_0-2_0": 2,
        "r_0-1_1": 1,
        "r_0-2_1": 1,
    }
    stats = thinker.debug_state()["sender"]
    assert (stats["puts"], stats["put_failures"], stats["dropped"]) == (4, 1, 0)
    assert conn.keys() == []
    conn.close()


def test_a_put_many_that_raises_retries_every_target(runtimes: list, ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    conn = CountingConnector(f"c-{ns}")
    real = conn._put_many
    raised: list[int] = []

    def once(targets: list[tuple[str, str, str]], data: Any) -> list[PutResult]:
        if not raised:
            raised.append(1)
            raise ConnectorError("injected: the backend is down")
        return real(targets, data)

    monkeypatch.setattr(conn, "_put_many", once)
    thinker, talker, detok = _runtimes(ns, conn, runtimes)
    got = _stream(thinker, (talker, detok), 1)
    assert [p["ids"]["output"] for p in got] == [[0], [0]] and raised == [1]
    assert thinker.debug_state()["sender"]["put_failures"] == 2
    conn.close()


def test_an_abort_frees_the_keys_of_every_route(runtimes: list, ns: str) -> None:
    conn = CountingConnector(f"c-{ns}")
    thinker, *_ = _runtimes(ns, conn, runtimes)
    req = Req("r")
    for step in range(3):
        thinker.send_chunk(req, {"ids": {"output": [step]}})
    assert thinker.wait_sends()
    assert sorted(conn.keys()) == sorted(f"r_0-{d}_{i}" for d in (1, 2) for i in range(3))
    thinker.cleanup_finished_request("r", aborted=True)
    assert thinker.wait_sends()
    assert conn.keys() == [] and thinker.active_request_count() == 0
    conn.close()


def test_a_connector_without_put_many_fans_out_with_a_put_per_destination(runtimes: list, ns: str) -> None:
    conn = ThirdParty(f"c-{ns}")
    thinker, talker, detok = _runtimes(ns, conn, runtimes)
    got = _stream(thinker, (talker, detok), 2)
    assert [p["ids"]["output"] for p in got] == [[0, 1], [0, 1]]
    assert conn.puts == ["r_0-1_0", "r_0-2_0", "r_0-1_1", "r_0-2_1"]
    assert thinker.debug_state()["sender"]["put_many"] == 2  # the base class's loop over put
    assert conn.inner.keys() == []
    conn.close()


def test_a_subclass_overriding_put_keeps_its_override_in_put_many(ns: str) -> None:
    """FlakyConnector overrides ``_put`` below MemoryConnector's ``_put_many``: put_many goes through its ``_put``."""
    conn = FlakyConnector(f"f-{ns}", fail_puts=1, fail_keys=lambda k: k == "b")
    results = conn.put_many([(0, 1, "a"), (0, 2, "b"), (0, 3, "c")], {"v": 1})
    assert [r.ok for r in results] == [True, False, True] and conn.attempts == ["a", "b", "c"]
    assert sorted(conn.keys()) == ["a", "c"]
    conn.close()


def test_put_many_contract_checks(ns: str) -> None:
    conn = MemoryConnector(MemoryConfig(namespace=f"m-{ns}", max_bytes=4000))
    results = conn.put_many([(0, 1, "a"), (0, 2, "b")], {"v": torch.zeros(700)})  # room for one of them
    assert [r.ok for r in results] == [True, False] and "full" in results[1].metadata["error"]
    assert conn.cleanup("a") and conn.put_many([], {"v": 1}) == []

    class Broken(MemoryConnector):
        def _put_many(self, targets: list[tuple[str, str, str]], data: Any) -> list[PutResult]:
            return [PutResult(True, 1)]  # one result for two targets: a plugin bug

    broken = Broken(MemoryConfig(namespace=f"b-{ns}"))
    with pytest.raises(ConnectorContractError, match="_put_many"):
        broken.put_many([(0, 1, "a"), (0, 2, "b")], {"v": 1})
    broken.close()
    conn.close()


KV_FAN_OUT = """
connectors:
  c: {name: memory, extra: {namespace: c-NS}}
stages:
  - {stage_id: 0, kv_transfer: true, kv_layout: nhd, output_connectors: {to_stage_1: c, to_stage_2: c}}
  - {stage_id: 1, kv_transfer: true, input_connectors: {from_stage_0: c}}
  - {stage_id: 2, kv_transfer: true, input_connectors: {from_stage_0: c}}
"""


def test_kv_fan_out_on_one_connector_extracts_and_puts_once(runtimes: list, ns: str) -> None:
    from omni_plugins.kv.testing import build_paged_caches, full_kv

    conn = CountingConnector(f"c-{ns}")
    cfg = parse_pipeline_config(KV_FAN_OUT.replace("NS", ns), filename="p.yaml")
    prefill = StageTransferRuntime.from_pipeline(cfg, 0, tuning=FAST, connectors={"c": conn}, close_connector=False)
    decoders = [StageTransferRuntime.from_pipeline(cfg, s, tuning=FAST) for s in (1, 2)]
    runtimes.extend([prefill, *decoders])
    assert len(prefill.kv_managers) == 1  # one send manager for both KV edges on the connector
    caches, todo = build_paged_caches({"r": full_kv("r", num_layers=2, seq_len=5, num_heads=2, head_dim=4)}, block_size=4)
    assert prefill.send_kv_cache(todo, caches, 4, "float32") == ["r"]
    assert conn.calls == [("put_many", ["r_0-1_0_0_0", "r_0-2_0_0_0"])]
    received = [rt.recv_kv_cache("r") for rt in decoders]
    assert all(p is not None and size > 0 for p, size in received)
    first, second = (p["layer_blocks"]["key_cache"] for p, _ in received)  # type: ignore[index]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    for rt in (prefill, *decoders):
        rt.cleanup_finished_request("r")
    assert conn.keys() == []
    conn.close()
