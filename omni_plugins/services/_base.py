"""``ConnectorServices``: what a plugin offers for one connector besides the connector itself."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from omni_plugins.services._types import Finding, PrivateServer, RawBaseline, RunScope

if TYPE_CHECKING:
    from omni_plugins.bench.targets import SizeTarget

#: the connector's settings model (``ConnectorServices[MyConfig]``)
ConfigT = TypeVar("ConfigT", bound=BaseModel)


class ConnectorServices(Generic[ConfigT]):
    """Subclass it and override the services your backend has; a service not overridden is not offered.

    Registered next to the connector as an import string
    (``registry.register(name, connector=..., config=..., services="pkg.services:MyServices")``), so
    it is imported only when a service is first asked for; keep heavy imports (client libraries,
    torch) inside the methods. One instance per process, created without arguments.

    ``config`` arguments are the connector's validated settings model (``ConfigT``: subclass
    ``ConnectorServices[MyConfig]``), exactly as the connector receives it: a service reaches the
    backend the connector of that config uses.
    """

    #: modules worth importing once in the fork server that starts stage processes (and test children),
    #: so each forked process has them already: typically the connector module and its client library
    preload: ClassVar[tuple[str, ...]] = ()

    #: environment variables a pipeline file reads this backend's server address from, each with a
    #: stand-in value: ``run --start-servers`` reads the file with the stand-ins to learn which servers
    #: to start, then sets the real values (:meth:`server_environment`)
    server_variables: ClassVar[Mapping[str, str]] = {}

    #: named config overlays ``omni-plugins bench`` measures next to the connector as configured, in the
    #: same run: a mode users switch on (``{"views": {"zero_copy": True}}``)
    bench_variants: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    #: the size curve's targets (:class:`omni_plugins.bench.targets.SizeTarget`): bounds on same-run
    #: ratios against the raw baseline that every ``omni-plugins bench`` run checks and records
    bench_targets: ClassVar[tuple[SizeTarget, ...]] = ()

    def census(self, config: ConfigT, run: RunScope) -> Finding:
        """What of the run ``run`` the backend still holds (count 0: nothing). Called after every stage process exited.

        Report what a stage left that would stay for good: payloads nobody will read, segments of
        dead processes. Match this run's keys where the backend can (:attr:`RunScope.request_prefix`),
        never other runs' data.
        """
        raise NotImplementedError

    def reclaim(self, config: ConfigT, run: RunScope) -> Finding:
        """Free what the run ``run`` left (a stage killed, a run interrupted); returns what was freed.

        Called after :meth:`census`, after every stage process exited. Touch only what is provably
        this run's or a dead process's.
        """
        raise NotImplementedError

    def start_server(self) -> PrivateServer:
        """Start a private server on a free loopback port and return it once it accepts connections.

        Raise :class:`ServiceUnavailable` when it cannot start here (its binary is missing). Used by
        ``omni-plugins run --start-servers``, ``omni-plugins bench`` and the ``omni_server`` pytest fixture.
        """
        raise NotImplementedError

    def server_environment(self, server: PrivateServer) -> Mapping[str, str]:
        """The values of :attr:`server_variables` that reach ``server`` (credentials included)."""
        raise NotImplementedError

    def bench_config(self, max_bytes: int, server: PrivateServer | None, scratch: Path) -> dict[str, Any]:
        """The connector config ``omni-plugins bench`` measures: it holds payloads of ``max_bytes``.

        ``server``: the private server started for the benchmark (None when the user named one in
        their own config); ``scratch``: a private directory removed after the benchmark.
        """
        raise NotImplementedError

    def raw_baseline(self, config: ConfigT, max_bytes: int, producer: bool) -> RawBaseline:
        """One end (the producer's or the consumer's) of the backend's raw baseline (see :class:`RawBaseline`).

        ``config`` is the validated :meth:`bench_config`, so both ends reach the backend the connector uses.
        """
        raise NotImplementedError

    def floor_baseline(self, config: ConfigT, max_bytes: int, producer: bool) -> RawBaseline:
        """One end of the floor: the raw baseline plus the least any connector of this backend has to add.

        What a connector cannot avoid given the contract (``put`` may not keep the caller's memory,
        so one staging copy; a consumer that knows only the key, so one lookup; tensors, not bytes,
        so a decode), done the cheapest way, with nothing else. Measured in the same run: where a
        target is out of reach, the floor proves it. Same protocol as :meth:`raw_baseline`.
        """
        raise NotImplementedError


#: every service a :class:`ConnectorServices` subclass may override
SERVICE_METHODS: tuple[str, ...] = (
    "census",
    "reclaim",
    "start_server",
    "server_environment",
    "bench_config",
    "raw_baseline",
    "floor_baseline",
)
#: every declaration (class attribute) it may set
SERVICE_ATTRIBUTES: tuple[str, ...] = ("server_variables", "bench_variants", "bench_targets", "preload")
#: all of them in documentation order (how ``omni-plugins list`` shows them)
_ORDER: tuple[str, ...] = (
    "census",
    "reclaim",
    "start_server",
    "server_environment",
    "server_variables",
    "bench_config",
    "raw_baseline",
    "floor_baseline",
    "bench_variants",
    "bench_targets",
    "preload",
)


def offered(services: ConnectorServices[Any] | type[ConnectorServices[Any]]) -> tuple[str, ...]:
    """The services ``services`` (an instance or the class) offers: the methods its class overrides, the attributes it sets."""
    cls = services if isinstance(services, type) else type(services)
    return tuple(
        n for n in _ORDER if (getattr(cls, n) is not getattr(ConnectorServices, n) if n in SERVICE_METHODS else bool(getattr(cls, n)))
    )
