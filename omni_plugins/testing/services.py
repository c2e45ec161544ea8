"""``ServicesContract``: conformance of a connector's services (:mod:`omni_plugins.services`).

Usage in a plugin's tests, next to its :class:`ConnectorContract`::

    class TestMyServices(ServicesContract):
        leftover = "killed"

        @pytest.fixture
        def connector_spec(self, tmp_path):
            return "mybackend", {"directory": str(tmp_path)}

Every test of a service the plugin does not offer is skipped; what it offers must work:
a census sees what a run left and a reclaim frees it, the private server serves the
connector and stops by pid, the raw and floor baselines move the bytes, the bench variants
are valid configs, the preload modules import.
"""

from __future__ import annotations

import importlib
import os
import signal
import uuid
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import torch

from omni_plugins.factory import create_connector, validate_connector_config
from omni_plugins.services import ConnectorServices, RunScope, offered, services_for
from omni_plugins.testing.processes import process_context
from omni_plugins.testing.pytest_plugin import ServerFactory, process_running


def _put_and_die(name: str, config: dict[str, Any], key: str) -> None:
    """In a child process: put ``key`` and die by SIGKILL, as a stage killed mid-run leaves its payloads."""
    connector = create_connector(name, config)
    if not connector.put(0, 1, key, {"x": torch.arange(1000, dtype=torch.float32)}).ok:
        raise SystemExit(f"put {key} failed")
    os.kill(os.getpid(), signal.SIGKILL)


class ServicesContract:
    """Conformance tests of a connector's services. Subclasses provide ``connector_spec`` (as for ``ConnectorContract``)."""

    #: where the census test's leftover comes from: a producer process SIGKILLed after its put ("killed"), or a
    #: connector of the test process held open and never read ("open": backends that free a dead client's data)
    leftover: ClassVar[Literal["killed", "open"]] = "killed"
    #: overrides for ``server.connector_config()`` when the server test connects to a fresh private server
    server_overrides: ClassVar[dict[str, Any]] = {}
    #: the largest payload of the raw-baseline test
    baseline_bytes: ClassVar[int] = 1 << 16

    @pytest.fixture
    def connector_spec(self) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError("provide a 'connector_spec' fixture returning (name, config_dict)")

    @pytest.fixture
    def services(self, connector_spec: tuple[str, dict[str, Any]]) -> ConnectorServices[Any]:
        found = services_for(connector_spec[0])
        assert found is not None, f"connector {connector_spec[0]!r} declares no services (registry.register(..., services=...))"
        return found

    def _offers(self, services: ConnectorServices[Any], service: str) -> None:
        if service not in offered(services):
            pytest.skip(f"the plugin offers no {service!r} service")

    # -- census and reclaim -------------------------------------------------------
    def test_census_sees_what_a_run_left_and_reclaim_frees_it(
        self, connector_spec: tuple[str, dict[str, Any]], services: ConnectorServices[Any]
    ) -> None:
        self._offers(services, "census")
        name, config = connector_spec
        settings = validate_connector_config(name, config)
        run = RunScope(uuid.uuid4().hex[:12])
        assert services.census(settings, run).count == 0, "the census finds something before anything was put"
        key = f"{run.request_prefix}00000_0_0"
        holder = None
        if self.leftover == "killed":
            ctx = process_context()
            child = ctx.Process(target=_put_and_die, args=(name, config, key))
            child.start()
            child.join(120)
            assert child.exitcode == -signal.SIGKILL, f"the producer ended with {child.exitcode}, not by SIGKILL"
        else:
            holder = create_connector(name, config)
            assert holder.put(0, 1, key, {"x": torch.arange(1000, dtype=torch.float32)}).ok
        try:
            found = services.census(settings, run)
            assert found.count >= 1, f"the census missed the payload a stopped producer left ({found})"
            assert found.census_line().startswith(f"{found.count} ")
            if not found.removed:
                self._offers(services, "reclaim")
                freed = services.reclaim(settings, run)
                assert freed.count >= 1, f"reclaim freed nothing of what the census found ({found})"
            assert services.census(settings, run).count == 0, "something of the run is left after reclaim"
        finally:
            if holder is not None:
                holder.close()

    # -- private server -------------------------------------------------------------
    def test_private_server_serves_the_connector_and_stops_by_pid(
        self, connector_spec: tuple[str, dict[str, Any]], services: ConnectorServices[Any]
    ) -> None:
        self._offers(services, "start_server")
        name, _ = connector_spec
        server = services.start_server()
        pid = server.pid
        try:
            assert pid is not None and process_running(pid)
            assert server.address.startswith(("127.0.0.1:", "/")), f"a private server listens on loopback only, not {server.address}"
            with create_connector(name, server.connector_config(**self.server_overrides)) as conn:
                key = f"server-{uuid.uuid4().hex}"
                assert conn.put(0, 1, key, {"v": torch.arange(8)}).ok
                got = conn.get(0, 1, key, timeout=10)
                assert got is not None and torch.equal(got.data["v"], torch.arange(8))
            if "server_environment" in offered(services):
                assert set(services.server_environment(server)) == set(services.server_variables)
        finally:
            server.stop()
        assert not process_running(pid), f"server pid {pid} still runs after stop()"
        server.stop()  # idempotent

    # -- bench ----------------------------------------------------------------------
    def test_bench_config_validates_and_the_raw_baseline_moves_the_bytes(
        self, connector_spec: tuple[str, dict[str, Any]], services: ConnectorServices[Any], tmp_path: Path, request: pytest.FixtureRequest
    ) -> None:
        self._offers(services, "raw_baseline")
        self._baseline_moves_the_bytes("raw_baseline", connector_spec, services, tmp_path, request)

    def test_the_floor_baseline_moves_the_bytes(
        self, connector_spec: tuple[str, dict[str, Any]], services: ConnectorServices[Any], tmp_path: Path, request: pytest.FixtureRequest
    ) -> None:
        self._offers(services, "floor_baseline")
        self._baseline_moves_the_bytes("floor_baseline", connector_spec, services, tmp_path, request)

    def test_bench_variants_are_valid_configs(self, connector_spec: tuple[str, dict[str, Any]], services: ConnectorServices[Any]) -> None:
        self._offers(services, "bench_variants")
        name, config = connector_spec
        for variant, overlay in services.bench_variants.items():
            try:
                validate_connector_config(name, {**config, **overlay})
            except Exception as exc:
                pytest.fail(f"bench variant {variant!r} ({dict(overlay)}) is not a valid {name} config: {exc}")

    def _baseline_moves_the_bytes(
        self,
        service: str,
        connector_spec: tuple[str, dict[str, Any]],
        services: ConnectorServices[Any],
        tmp_path: Path,
        request: pytest.FixtureRequest,
    ) -> None:
        name, config = connector_spec
        server = None
        if "start_server" in offered(services):
            omni_server: ServerFactory = request.getfixturevalue("omni_server")
            server = omni_server(name)
        validate_connector_config(name, services.bench_config(self.baseline_bytes, server, tmp_path))
        settings = validate_connector_config(name, config)
        make = getattr(services, service)
        producer = make(settings, self.baseline_bytes, True)
        consumer = make(settings, self.baseline_bytes, False)
        try:
            hello = dict(producer.handshake())
            consumer.connect(hello)
            producer.connect(dict(consumer.handshake()))
            kept = []
            for i, size in enumerate((1, self.baseline_bytes // 3, self.baseline_bytes)):
                payload = torch.randint(0, 256, (size,), dtype=torch.uint8)
                producer.put(f"{service}-{i}", payload)
                got = consumer.get(f"{service}-{i}", size)
                assert got.dtype == torch.uint8 and torch.equal(got, payload), f"the {service} changed {size} bytes"
                kept.append((got, payload.clone()))
            for got, want in kept:  # the consumer owns each copy: the next put and get do not change it
                assert torch.equal(got, want), f"a get of the {service} returned memory that the next transfer overwrote"
        finally:
            consumer.close()
            producer.close()

    # -- preload ----------------------------------------------------------------------
    def test_preload_modules_import(self, services: ConnectorServices[Any]) -> None:
        self._offers(services, "preload")
        for module in services.preload:
            importlib.import_module(module)
