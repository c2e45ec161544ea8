"""``ConnectorContract``: the conformance suite every connector should pass.

Usage in a plugin's tests::

    class TestMyConnector(ConnectorContract):
        cross_process = True
        bad_config = {"port": -1}

        @pytest.fixture
        def connector_spec(self):
            return "mybackend", {"host": "127.0.0.1", "port": server.port}
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from omni_plugins.contract import Connector, GetResult, PutResult, PutTarget
from omni_plugins.errors import ConfigError, ConnectorClosedError
from omni_plugins.factory import create_connector
from omni_plugins.testing.payloads import assert_payload_equal
from omni_plugins.testing.processes import process_context

ALL_DTYPES: tuple[torch.dtype, ...] = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip


def _tensor_of(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),), generator=g, dtype=torch.uint8
    )
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(shape)
    if dtype.is_floating_point or dtype.is_complex:
        # random bits would include NaNs whose payload bits need not survive arithmetic; build real values
        real = torch.randn(shape, generator=g, dtype=torch.float64 if not dtype.is_complex else torch.complex128)
        return real.to(dtype)
    return raw.view(dtype).reshape(shape)


def sample_payload(seed: int = 0) -> dict[str, Any]:
    """A nested payload with every allowed dtype plus bfloat16, non-contiguous, 0-d and empty tensors."""
    tensors = {str(dt).removeprefix("torch."): _tensor_of(dt, (3, 5), seed + i) for i, dt in enumerate(ALL_DTYPES)}
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "meta": {"finished": False, "override_keys": ["codes.audio"], "next_stage_prompt_len": 7, "left_context_size": 0},
        "embed": {"decode": _tensor_of(torch.bfloat16, (4, 8), seed), "decode_token_start": 3, "decode_token_end": 7},
        "ids": {"output": [1, 2, 3]},
        "codes": {"audio": _tensor_of(torch.int64, (2, 16), seed + 99)},
        "tensors": tensors,
        "special": {
            "non_contiguous": base.t(),
            "scalar": torch.tensor(2.5, dtype=torch.float32),
            "empty": torch.empty((0, 4), dtype=torch.float16),
        },
        "scalars": [None, True, 0, -(2**40), 1.5, "text ünïcode", b"\x00bytes"],
        "tuple": (1, "two"),
    }


def _child_get_then_put(name: str, config: dict[str, Any], key: str, key_back: str, out: Any, done: Any) -> None:
    """In a spawned process: get the parent's payload, report it, put one back, hold it until told.

    One child does both directions: starting a process that imports torch is most of the
    test's time.
    """
    with create_connector(name, config) as conn:
        res = conn.get(0, 1, key, timeout=30)
        out.put(None if res is None else (float(res.data["values"].double().sum()), int(res.data["values"].numel()), res.data["tag"]))
        ok = conn.put(1, 2, key_back, {"values": torch.arange(1000, dtype=torch.float32), "tag": "from-child"}).ok
        out.put(ok)
        done.wait(60)


class ConnectorContract:
    """Conformance tests. Subclasses provide ``connector_spec`` and may override the class attributes."""

    #: the connector must make a put in one process visible to a get in another
    cross_process: ClassVar[bool] = True
    #: a config dict that the connector's model must reject
    bad_config: ClassVar[dict[str, Any] | None] = None
    #: how long tests wait for a blocking get
    wait_timeout: ClassVar[float] = 10.0

    @pytest.fixture
    def connector_spec(self) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError("provide a 'connector_spec' fixture returning (name, config_dict)")

    @pytest.fixture
    def connector(self, connector_spec: tuple[str, dict[str, Any]]) -> Iterator[Connector]:
        name, config = connector_spec
        conn = create_connector(name, config)
        try:
            yield conn
        finally:
            conn.close()

    @pytest.fixture
    def key(self) -> str:
        return f"contract-{uuid.uuid4().hex}"

    # -- round trips --------------------------------------------------------
    def test_roundtrip_nested_payload(self, connector: Connector, key: str) -> None:
        payload = sample_payload(1)
        res = connector.put(0, 1, key, payload)
        assert isinstance(res, PutResult) and res.ok and res.size > 0
        got = connector.get(0, 1, key, timeout=self.wait_timeout)
        assert isinstance(got, GetResult)
        assert got.size > 0
        assert_payload_equal(got.data, payload)

    def test_received_tensors_are_independent_of_sender(self, connector: Connector, key: str) -> None:
        src = torch.zeros(64)
        connector.put(0, 1, key, {"x": src})
        src.fill_(7.0)  # mutating after put must not change what was sent
        got = connector.get(0, 1, key, timeout=self.wait_timeout)
        assert got is not None and float(got.data["x"].sum()) == 0.0

    def test_stage_ids_may_be_int_or_str(self, connector: Connector, key: str) -> None:
        assert connector.put("0", "1", key, {"v": 1}).ok
        got = connector.get(0, 1, key, timeout=self.wait_timeout)
        assert got is not None and got.data == {"v": 1}

    def test_missing_key_returns_none(self, connector: Connector, key: str) -> None:
        assert connector.get(0, 1, key) is None
        assert connector.get(0, 1, key, timeout=0.05) is None

    def test_get_consumes(self, connector: Connector, key: str) -> None:
        assert connector.put(0, 1, key, {"v": torch.ones(3)}).ok
        assert connector.get(0, 1, key, timeout=self.wait_timeout) is not None
        assert connector.get(0, 1, key) is None

    def test_get_after_cleanup_returns_none(self, connector: Connector, key: str) -> None:
        assert connector.put(0, 1, key, {"v": torch.ones(3)}).ok
        assert connector.cleanup(key) is True
        assert connector.get(0, 1, key) is None
        assert connector.cleanup(key) is False

    # -- put_many (one payload under several keys: a fan-out) ---------------------
    @pytest.mark.parametrize("elements", [1024, 768 << 10], ids=["4KiB", "3MiB"])
    def test_put_many_stores_every_key_on_its_own(self, connector: Connector, key: str, elements: int) -> None:
        """Each key then holds the payload as after one put per key: read, consumed and cleaned up on its own."""
        src = torch.arange(elements, dtype=torch.float32)
        payload = {**sample_payload(2), "big": src}
        expected = {**payload, "big": src.clone()}
        keys = [f"{key}-{i}" for i in range(3)]
        results = connector.put_many([PutTarget(0, i + 1, k) for i, k in enumerate(keys)], payload)
        assert [type(r) for r in results] == [PutResult] * 3
        assert all(r.ok for r in results) and len({r.size for r in results}) == 1 and results[0].size > 0
        src.fill_(7.0)  # mutating after put_many changes none of them
        first = connector.get(0, 1, keys[0], timeout=self.wait_timeout)
        assert first is not None
        assert_payload_equal(first.data, expected)
        assert connector.cleanup(keys[1]) is True
        last = connector.get(0, 3, keys[2], timeout=self.wait_timeout)
        assert last is not None
        assert_payload_equal(last.data, expected)
        assert connector.get(0, 2, keys[1]) is None
        assert connector.get(0, 1, keys[0]) is None
        assert connector.put_many([], payload) == []

    def test_blocking_get_sees_later_put(self, connector: Connector, connector_spec: tuple[str, dict[str, Any]], key: str) -> None:
        name, config = connector_spec
        producer = create_connector(name, config)
        timer = threading.Timer(0.2, lambda: producer.put(0, 1, key, {"late": torch.arange(5)}))
        timer.start()
        try:
            got = connector.get(0, 1, key, timeout=self.wait_timeout)
        finally:
            timer.join()
        try:
            assert got is not None
            assert torch.equal(got.data["late"], torch.arange(5))
        finally:
            producer.close()

    # -- wait_any (only connectors that claim the capability) ----------------
    def test_wait_any_sees_later_put(self, connector: Connector, connector_spec: tuple[str, dict[str, Any]], key: str) -> None:
        if not connector.capabilities.wait_any:
            pytest.skip("connector does not offer wait_any")
        name, config = connector_spec
        keys = [f"{key}-{i}" for i in range(10)]
        producer = create_connector(name, config)
        timer = threading.Timer(0.2, lambda: producer.put(0, 1, keys[6], {"v": torch.arange(3)}))
        timer.start()
        try:
            ready = connector.wait_any(keys, timeout=10)
        finally:
            timer.join()
        try:
            assert keys[6] in ready
            assert set(ready) <= set(keys)
            got = connector.get(0, 1, keys[6])  # wait_any consumed nothing
            assert got is not None and torch.equal(got.data["v"], torch.arange(3))
        finally:
            producer.close()

    def test_wait_any_takes_a_set_or_a_keys_view(self, connector: Connector, key: str) -> None:
        """Any collection of keys: a list, a set, a dict's keys view (a runtime's table of pending keys)."""
        if not connector.capabilities.wait_any:
            pytest.skip("connector does not offer wait_any")
        keys = [f"{key}-{i}" for i in range(70)]  # past the size where a look may read the whole table
        pending = dict.fromkeys(keys)
        connector.put(0, 1, keys[41], {"v": torch.arange(2)})
        for waited in (pending.keys(), set(keys), keys):
            assert connector.wait_any(waited, timeout=5) == [keys[41]]
            assert connector.poll_any(waited, timeout=5) == [keys[41]]
        del pending[keys[41]]
        assert connector.wait_any(pending.keys(), timeout=0.05) == []
        assert connector.get(0, 1, keys[41]) is not None

    def test_wait_any_on_absent_keys_returns_empty(self, connector: Connector, key: str) -> None:
        if not connector.capabilities.wait_any:
            pytest.skip("connector does not offer wait_any")
        assert connector.wait_any([f"{key}-{i}" for i in range(10)], timeout=0.05) == []
        assert connector.wait_any([], timeout=0.05) == []

    # -- poll_any (every connector: without the capability it is wait_any) ----
    def test_poll_any(self, connector: Connector, connector_spec: tuple[str, dict[str, Any]], key: str) -> None:
        """One test (one connector set-up per backend): present key, absent keys, a later put."""
        caps = connector.capabilities
        keys = [f"{key}-{i}" for i in range(5)]
        connector.put(0, 1, keys[3], {"v": torch.arange(4)})
        ready = connector.poll_any(keys, timeout=5)
        assert keys[3] in ready and set(ready) <= set(keys)
        got = connector.get(0, 1, keys[3])  # poll_any consumed nothing
        assert got is not None and torch.equal(got.data["v"], torch.arange(4))
        assert connector.poll_any([], timeout=0.01) == []
        if caps.poll_any or caps.wait_any:  # precise waits; otherwise a wait only says "possibly" (every key)
            assert connector.poll_any(keys, timeout=0.01) == []
        if not caps.poll_any:
            return
        name, config = connector_spec
        producer = create_connector(name, config)
        timer = threading.Timer(0.005, lambda: producer.put(0, 1, keys[1], {"v": 7}))
        timer.start()
        try:
            ready = []
            for _ in range(2000):  # a poll may end (its own bound) before the put: poll again, as a runtime would
                ready = connector.poll_any(keys, timeout=0.01)
                if ready:
                    break
        finally:
            timer.join()
        try:
            assert ready == [keys[1]]
            assert connector.get(0, 1, keys[1]) is not None
        finally:
            producer.close()

    def test_health_reports_ok(self, connector: Connector) -> None:
        status = connector.health()
        assert status["ok"] is True
        assert "connector" in status

    # -- lifecycle ----------------------------------------------------------
    def test_close_is_idempotent_and_use_after_close_raises(self, connector_spec: tuple[str, dict[str, Any]], key: str) -> None:
        name, config = connector_spec
        conn = create_connector(name, config)
        conn.close()
        conn.close()
        assert conn.closed
        with pytest.raises(ConnectorClosedError):
            conn.put(0, 1, key, {"v": 1})
        with pytest.raises(ConnectorClosedError):
            conn.get(0, 1, key)
        with pytest.raises(ConnectorClosedError):
            conn.put_many([(0, 1, key), (0, 2, key + "-2")], {"v": 1})
        assert conn.health()["ok"] is False

    def test_context_manager_closes(self, connector_spec: tuple[str, dict[str, Any]]) -> None:
        name, config = connector_spec
        with create_connector(name, config) as conn:
            assert not conn.closed
        assert conn.closed

    def test_bad_config_rejected(self, connector_spec: tuple[str, dict[str, Any]]) -> None:
        from omni_plugins.factory import resolve_connector
        from omni_plugins.naming import canonical

        name, _ = connector_spec
        bad = self.bad_config if self.bad_config is not None else {"definitely_not_a_field": 1}
        with pytest.raises(ConfigError) as info:
            create_connector(name, bad)
        message = canonical(str(info.value))
        # the error names the connector (by its registered name, whatever alias the spec used)
        assert canonical(resolve_connector(name).name) in message, message

    # -- concurrency ----------------------------------------------------------
    def test_eight_threads_put_and_get(self, connector_spec: tuple[str, dict[str, Any]]) -> None:
        name, config = connector_spec
        producer = create_connector(name, config)
        consumer = create_connector(name, config)
        prefix = uuid.uuid4().hex
        errors: list[str] = []

        def work(i: int) -> None:
            for j in range(10):
                key = f"{prefix}-{i}-{j}"
                value = torch.full((32 + i,), float(i * 100 + j))
                try:
                    if not producer.put(0, 1, key, {"v": value}).ok:
                        errors.append(f"put {key} failed")
                        continue
                    got = consumer.get(0, 1, key, timeout=self.wait_timeout)
                except Exception as exc:  # a connector that is not thread-safe: say how, not just that a thread died
                    errors.append(f"thread {i}, key {key}: {type(exc).__name__}: {exc}")
                    continue
                if got is None or not torch.equal(got.data["v"], value):
                    errors.append(f"get {key} returned {None if got is None else got.data}")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        try:
            assert not any(t.is_alive() for t in threads), "a worker thread hung"
            assert errors == [], f"{len(errors)} of 80 put/get pairs from 8 threads failed:\n" + "\n".join(errors[:10])
        finally:
            producer.close()
            consumer.close()

    # -- across processes -------------------------------------------------------
    def test_visible_from_another_process(self, connector: Connector, connector_spec: tuple[str, dict[str, Any]], key: str) -> None:
        if not self.cross_process:
            pytest.skip("connector is in-process only")
        name, config = connector_spec
        ctx = process_context()
        # parent puts, child gets; then child puts, parent gets
        values = torch.arange(2048, dtype=torch.float64)
        assert connector.put(0, 1, key, {"values": values, "tag": "from-parent"}).ok
        key2 = key + "-back"
        out, done = ctx.Queue(), ctx.Event()
        child = ctx.Process(target=_child_get_then_put, args=(name, config, key, key2, out, done))
        child.start()
        try:
            assert out.get(timeout=120) == (float(values.sum()), 2048, "from-parent")
            assert out.get(timeout=60) is True
            got = connector.get(1, 2, key2, timeout=self.wait_timeout)
            assert got is not None and got.data["tag"] == "from-child"
            assert torch.equal(got.data["values"], torch.arange(1000, dtype=torch.float32))
        finally:
            done.set()
            child.join(60)
        assert child.exitcode == 0
