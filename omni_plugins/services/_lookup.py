"""Finding a connector's services: through the registry, imported on first use, checked, one instance per process."""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from omni_plugins.errors import PluginLoadError
from omni_plugins.importing import import_string
from omni_plugins.naming import close_matches
from omni_plugins.services._base import SERVICE_ATTRIBUTES, SERVICE_METHODS, ConnectorServices, offered
from omni_plugins.services._types import ServiceUnavailable

if TYPE_CHECKING:
    from omni_plugins.registry import ConnectorSpec

log = logging.getLogger(__name__)

_instances: dict[str, ConnectorServices[Any]] = {}
_lock = threading.Lock()

#: services that only work together: offering the first needs the second
_PAIRS = (
    ("raw_baseline", "bench_config"),
    ("server_environment", "start_server"),
    ("floor_baseline", "raw_baseline"),
    ("bench_variants", "raw_baseline"),
    ("bench_targets", "raw_baseline"),
)


def load_services(spec: ConnectorSpec) -> ConnectorServices[Any] | None:
    """The services ``spec``'s plugin declared for it (None: none declared); imported and checked on first use."""
    if spec.services is None:
        return None
    with _lock:
        found = _instances.get(spec.services)
        if found is None:
            found = _instances[spec.services] = _create(spec)
        return found


def services_for(name: str) -> ConnectorServices[Any] | None:
    """The services of connector ``name`` (a registered name or alias); None when its plugin declares none."""
    from omni_plugins.factory import resolve_connector

    return load_services(resolve_connector(name))


def require(name: str, service: str) -> ConnectorServices[Any]:
    """The services of connector ``name`` if they offer ``service``; else :class:`ServiceUnavailable` saying so."""
    from omni_plugins.factory import resolve_connector

    spec = resolve_connector(name)
    services = load_services(spec)
    if services is None or service not in offered(services):
        raise ServiceUnavailable(f"connector {spec.name!r} ({spec.origin}) offers no {service!r} service")
    return services


def registered_services() -> dict[str, ConnectorServices[Any]]:
    """Every registered connector's services, by connector name (imports each services module).

    Services that fail to load are left out and logged: one broken plugin does not take the others' services down.
    """
    from omni_plugins.plugins import get_plugin_manager

    out = {}
    for spec in get_plugin_manager().registry.specs():
        try:
            services = load_services(spec)
        except PluginLoadError as exc:
            log.warning("%s", exc)
            continue
        if services is not None:
            out[spec.name] = services
    return out


def preload_modules(connectors: Iterable[str] | None = None) -> list[str]:
    """The ``preload`` modules of the services of ``connectors`` (names; None: every registered connector), in order, once each.

    A connector that is not registered or whose services fail to load adds nothing: preloading is an optimisation.
    """
    if connectors is None:
        found = list(registered_services().values())
    else:
        found = []
        for name in connectors:
            try:
                services = services_for(name)
            except Exception:
                continue
            if services is not None:
                found.append(services)
    return list(dict.fromkeys(m for services in found for m in services.preload))


def _create(spec: ConnectorSpec) -> ConnectorServices[Any]:
    where = f"services {spec.services!r} of connector {spec.name!r} ({spec.origin})"
    try:
        cls = import_string(spec.services or "")
    except ImportError as exc:
        raise PluginLoadError(f"{where} cannot be imported: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, ConnectorServices)):
        raise PluginLoadError(f"{where} is not a subclass of omni_plugins.services.ConnectorServices")
    check_services_class(cls, where)
    return cls()


def check_services_class(cls: type[ConnectorServices[Any]], where: str) -> None:
    """Refuse what would silently offer nothing: a misspelled service, a wrong declaration, half of a pair."""
    known = set(SERVICE_METHODS) | set(SERVICE_ATTRIBUTES)
    for klass in cls.__mro__:
        if klass is ConnectorServices or klass is object:
            continue
        for attr in vars(klass):
            if attr.startswith("_") or attr in known:
                continue
            hint = close_matches(attr, sorted(known), n=1, cutoff=0.75)
            if hint:
                raise PluginLoadError(f"{where} defines {attr!r}: not a service; did you mean {hint[0]!r}?")
    for attr in SERVICE_METHODS:
        method = getattr(cls, attr)
        if not callable(method):
            raise PluginLoadError(f"{where}: {attr} must be a method, got {type(method).__name__}")
        expected = inspect.signature(getattr(ConnectorServices, attr))
        actual = inspect.signature(method)
        if len(actual.parameters) != len(expected.parameters):
            raise PluginLoadError(f"{where}: {attr}{actual} does not take the arguments of ConnectorServices.{attr}{expected}")
    if not (isinstance(cls.preload, tuple) and all(isinstance(m, str) for m in cls.preload)):
        raise PluginLoadError(f"{where}: preload must be a tuple of module names, got {cls.preload!r}")
    variables = cls.server_variables
    if not (isinstance(variables, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items())):
        raise PluginLoadError(f"{where}: server_variables must map variable names to stand-in values, got {variables!r}")
    _check_bench_declarations(cls, where)
    has = set(offered(cls))
    for needs, partner in _PAIRS:
        if needs in has and partner not in has:
            raise PluginLoadError(f"{where} offers {needs!r} without {partner!r}; the one needs the other")
    if ("server_environment" in has) != bool(variables):
        raise PluginLoadError(f"{where}: server_environment and server_variables go together (the values of those variables)")


def _check_bench_declarations(cls: type[ConnectorServices[Any]], where: str) -> None:
    """``bench_variants`` maps names to config overlays; ``bench_targets`` holds SizeTargets naming known variants."""
    from omni_plugins.bench.targets import SizeTarget

    variants = cls.bench_variants
    if not (isinstance(variants, Mapping) and all(isinstance(k, str) and k and isinstance(v, Mapping) for k, v in variants.items())):
        raise PluginLoadError(f"{where}: bench_variants must map variant names to config overlays, got {variants!r}")
    targets = cls.bench_targets
    if not (isinstance(targets, tuple) and all(isinstance(t, SizeTarget) for t in targets)):
        raise PluginLoadError(f"{where}: bench_targets must be a tuple of omni_plugins.bench.targets.SizeTarget, got {targets!r}")
    for t in targets:
        if t.variant and t.variant not in variants:
            raise PluginLoadError(f"{where}: bench target {t.description!r} names variant {t.variant!r}, which bench_variants lacks")
