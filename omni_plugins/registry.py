"""The connector registry: what plugins registered, looked up by canonical name.

Entries hold import strings, not classes, so registering a connector imports
nothing heavy; the class and its config model are imported when chosen.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from omni_plugins.errors import ConnectorNotFoundError, DuplicateConnectorError, PluginLoadError
from omni_plugins.importing import import_string
from omni_plugins.naming import KNOWN_BACKENDS, canonical, close_matches

if TYPE_CHECKING:
    from pydantic import BaseModel

    from omni_plugins.contract import Connector
    from omni_plugins.services import ConnectorServices


@dataclass(frozen=True)
class ConnectorSpec:
    """One registered connector: where its class and config model live, and who provided it."""

    name: str
    connector: str
    config: str | None = None
    aliases: tuple[str, ...] = ()
    description: str = ""
    #: import string of its :class:`omni_plugins.services.ConnectorServices` subclass, if the plugin offers services
    services: str | None = None
    plugin: str = ""
    distribution: str | None = None
    version: str | None = None

    @property
    def canonical_name(self) -> str:
        return canonical(self.name)

    @property
    def origin(self) -> str:
        """Who provides this connector, for error messages: ``plugin 'x' (dist version)``."""
        who = " ".join(p for p in (self.distribution, self.version) if p)
        return f"plugin {self.plugin!r}" + (f" ({who})" if who else "")

    def load_class(self) -> type[Connector]:
        """Import the connector class and check what can be checked without creating one.

        A class that cannot be instantiated (abstract primitives left) or whose ``__init__`` cannot take the
        config model as its only argument fails here -- at ``validate`` time -- rather than in a stage process.
        """
        from omni_plugins.contract import Connector

        try:
            cls = import_string(self.connector)
        except ImportError as exc:
            raise PluginLoadError(f"connector {self.name!r} ({self.origin}) cannot be imported from {self.connector!r}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Connector)):
            raise PluginLoadError(f"{self.connector!r} (connector {self.name!r}, {self.origin}) is not a subclass of omni_plugins.Connector")
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise PluginLoadError(
                f"connector class {self.connector!r} (connector {self.name!r}, {self.origin}) does not implement {', '.join(missing)}"
            )
        try:
            signature = inspect.signature(cls)
        except (TypeError, ValueError):  # no introspectable signature: the call itself will tell
            signature = None
        if signature is not None:
            try:
                signature.bind(object())
            except TypeError as exc:
                raise PluginLoadError(
                    f"connector class {self.connector!r} (connector {self.name!r}, {self.origin}) must accept its config model as "
                    f"the only argument, __init__{signature}: {exc}"
                ) from None
        return cls

    def load_config_model(self) -> type[BaseModel]:
        from pydantic import BaseModel

        from omni_plugins.settings import ConnectorSettings

        if self.config is None:
            cls = self.load_class()
            model = getattr(cls, "config_model", None)
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                return ConnectorSettings
            return self._check_forbids_extra(model, f"{self.connector}.config_model")
        try:
            model = import_string(self.config)
        except ImportError as exc:
            raise PluginLoadError(
                f"config model of connector {self.name!r} ({self.origin}) cannot be imported from {self.config!r}: {exc}"
            ) from exc
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise PluginLoadError(f"{self.config!r} (config of connector {self.name!r}, {self.origin}) is not a pydantic model")
        return self._check_forbids_extra(model, self.config)

    def load_services(self) -> ConnectorServices[Any] | None:
        """Its services (imported and checked on first use, one instance per process); None when none are declared."""
        from omni_plugins.services import load_services

        return load_services(self)

    def _check_forbids_extra(self, model: type[BaseModel], where: str) -> type[BaseModel]:
        """A model that ignores unknown keys would turn a typo in the YAML's ``extra:`` into a silently used default."""
        if model.model_config.get("extra") != "forbid":
            raise PluginLoadError(
                f"config model {where!r} of connector {self.name!r} ({self.origin}) accepts unknown fields "
                f"(extra={model.model_config.get('extra', 'ignore')!r}), so a misspelled setting would be ignored: "
                "derive it from omni_plugins.ConnectorSettings (or set model_config extra='forbid')"
            )
        return model

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "aliases": list(self.aliases),
            "connector": self.connector,
            "config": self.config,
            "description": self.description,
            "services": self.services,
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
        }


#: a :class:`VllmOmniName` with this name serves every vLLM-Omni connector name no plugin declares
ANY_VLLM_OMNI_NAME = "*"


@dataclass(frozen=True)
class VllmOmniName:
    """How a connector of a vLLM-Omni YAML file (``name: SharedMemoryConnector``, ``extra: {...}``) reads in omni-plugins.

    Declared by the plugin that serves it (:meth:`RegistrationSink.register_vllm_omni`); the core
    names no backend. ``keys`` renames vLLM-Omni's ``extra`` keys to the connector's settings;
    ``unused`` lists vLLM-Omni keys the connector has no use for, each with the reason (they are
    kept, listed in the loader's warning); keys the connector's settings model knows pass as they
    are; any other key is left to the payload builders. ``translate`` (an import string of
    ``f(name, extra) -> (connector, settings)``) replaces that for a connector whose ``extra`` is
    shaped differently; it raises ``ValueError`` saying what is wrong or missing.
    """

    name: str
    #: the omni-plugins connector (a registered name) it becomes; None when ``translate`` decides
    connector: str | None = None
    keys: Mapping[str, str] = field(default_factory=dict)
    unused: Mapping[str, str] = field(default_factory=dict)
    translate: str | None = None
    description: str = ""
    plugin: str = ""
    distribution: str | None = None
    version: str | None = None

    @property
    def origin(self) -> str:
        who = " ".join(p for p in (self.distribution, self.version) if p)
        return f"plugin {self.plugin!r}" + (f" ({who})" if who else "")


@dataclass
class ConnectorRegistry:
    """All registered connectors, keyed by canonical name and alias.

    A name (or alias) registered by two distributions is kept under both;
    looking it up raises :class:`DuplicateConnectorError` naming both, and
    ``dist:name`` picks one.
    """

    _by_name: dict[str, list[ConnectorSpec]] = field(default_factory=dict)
    #: canonical plugin/distribution name -> cause, for names whose plugin failed to load
    failed_plugins: dict[str, BaseException] = field(default_factory=dict)
    #: connector names a failed plugin is known to provide (from the same canonical plugin name)
    _failed_hint: dict[str, str] = field(default_factory=dict)
    #: canonical plugin / distribution / distribution-suffix name -> (plugin, distribution, why), for installed plugins not loaded
    _skipped: dict[str, tuple[str, str | None, str]] = field(default_factory=dict)
    #: vLLM-Omni connector name (exact, as its YAML spells it) -> declarations of how it reads here
    _vllm_omni: dict[str, list[VllmOmniName]] = field(default_factory=dict)

    def add(self, spec: ConnectorSpec) -> None:
        for key in {spec.canonical_name, *(canonical(a) for a in spec.aliases)}:
            bucket = self._by_name.setdefault(key, [])
            if any(s.connector == spec.connector and s.distribution == spec.distribution for s in bucket):
                continue  # the same plugin registering again (idempotent)
            bucket.append(spec)

    def remove_plugin(self, plugin: str) -> None:
        for key in list(self._by_name):
            self._by_name[key] = [s for s in self._by_name[key] if s.plugin != plugin]
            if not self._by_name[key]:
                del self._by_name[key]
        for key in list(self._vllm_omni):
            self._vllm_omni[key] = [d for d in self._vllm_omni[key] if d.plugin != plugin]
            if not self._vllm_omni[key]:
                del self._vllm_omni[key]

    def add_vllm_omni(self, decl: VllmOmniName) -> None:
        bucket = self._vllm_omni.setdefault(decl.name, [])
        if not any(d.plugin == decl.plugin and d.distribution == decl.distribution for d in bucket):
            bucket.append(decl)

    def vllm_omni_names(self) -> list[VllmOmniName]:
        """Every declared vLLM-Omni connector name, sorted (the catch-all ``*`` last)."""
        return sorted((d for bucket in self._vllm_omni.values() for d in bucket), key=lambda d: (d.name == ANY_VLLM_OMNI_NAME, d.name))

    def vllm_omni_name(self, name: str, *, catch_all: bool = True) -> VllmOmniName | None:
        """How vLLM-Omni connector ``name`` reads here: its declaration, else (``catch_all``) the ``*`` one, else None.

        Two distributions declaring the same name is an error naming both.
        """
        bucket = self._vllm_omni.get(name) or (self._vllm_omni.get(ANY_VLLM_OMNI_NAME) if catch_all else None) or []
        if len(bucket) > 1:
            who = ", ".join(d.origin for d in bucket)
            raise DuplicateConnectorError(f"vLLM-Omni connector name {name!r} is declared by more than one plugin: {who}; uninstall one")
        return bucket[0] if bucket else None

    def specs(self) -> list[ConnectorSpec]:
        """Every registered connector once (aliases folded), sorted by name."""
        seen: dict[tuple[str, str | None, str], ConnectorSpec] = {}
        for bucket in self._by_name.values():
            for s in bucket:
                seen[(s.connector, s.distribution, s.name)] = s
        return sorted(seen.values(), key=lambda s: (s.canonical_name, s.distribution or ""))

    def names(self) -> list[str]:
        return sorted({s.name for s in self.specs()})

    def view(self) -> Mapping[str, tuple[ConnectorSpec, ...]]:
        """Read-only view: canonical name or alias -> specs registered under it."""
        return MappingProxyType({k: tuple(v) for k, v in self._by_name.items()})

    def note_failed(self, plugin: str, exc: BaseException, provides: Iterable[str] = ()) -> None:
        self.failed_plugins[canonical(plugin)] = exc
        for name in provides:
            self._failed_hint[canonical(name)] = canonical(plugin)

    def note_skipped(self, plugin: str, distribution: str | None, why: str) -> None:
        """``plugin`` is installed but was not loaded (``why``: disabled, not allowed), so a lookup can say so."""
        entry = (plugin, distribution, why)
        for n in (plugin, distribution, distribution.removeprefix("omni-plugins-") if distribution else None):
            if n:
                self._skipped[canonical(n)] = entry

    def resolve(self, name: str) -> ConnectorSpec:
        """Find the spec for ``name``, ``dist:name`` or raise a helpful error."""
        if not isinstance(name, str) or not name.strip():
            raise ConnectorNotFoundError("connector name is empty")
        dist_part, sep, bare = name.partition(":")
        if sep:
            matches = [s for s in self._by_name.get(canonical(bare), []) if canonical(s.distribution or "") == canonical(dist_part)]
            if matches:
                return matches[0]
            raise self._not_found(name)
        bucket = self._by_name.get(canonical(name), [])
        if len({(s.distribution, s.connector) for s in bucket}) > 1:
            who = ", ".join(f"{s.distribution} ({s.connector})" for s in bucket)
            picks = " or ".join(f"'{s.distribution}:{canonical(name)}'" for s in bucket)
            raise DuplicateConnectorError(
                f"connector name {name!r} is registered by more than one distribution: {who}; choose one with {picks}"
            )
        if bucket:
            return bucket[0]
        raise self._not_found(name)

    def _not_found(self, name: str) -> ConnectorNotFoundError:
        dist_part, sep, bare = name.partition(":")
        key = canonical(bare or name)
        providers = sorted({s.distribution or "(unknown distribution)" for s in self._by_name.get(key, [])}) if sep else []
        if providers:
            picks = " or ".join(f"'{d}:{bare.strip()}'" for d in providers)
            return ConnectorNotFoundError(
                f"connector {name!r}: distribution {dist_part.strip()!r} does not provide a connector {bare.strip()!r}; "
                f"{', '.join(providers)} does: use {picks}" + (f" (or just '{bare.strip()}')" if len(providers) == 1 else "")
            )
        failed_plugin = self._failed_hint.get(key) or (key if key in self.failed_plugins else None)
        if failed_plugin is not None and failed_plugin in self.failed_plugins:
            cause = self.failed_plugins[failed_plugin]
            err = ConnectorNotFoundError(f"connector {name!r} is unavailable: its plugin {failed_plugin!r} failed to load: {cause}")
            err.__cause__ = cause
            return err
        available = self.names()
        skipped = self._skipped.get(key)
        if skipped is None and key in KNOWN_BACKENDS:
            skipped = self._skipped.get(canonical(KNOWN_BACKENDS[key].partition("[")[0]))
        if skipped is not None:
            plugin, dist, why = skipped
            parts = [f"connector {name!r} is unavailable: its plugin {plugin!r} ({dist or 'unknown distribution'}) is installed but {why}."]
        else:
            parts = [f"unknown connector {name!r}."]
            displayed = {n for s in self.specs() for n in (s.name, *s.aliases)}
            hints = close_matches(key, sorted(displayed))
            if hints:
                parts.append(f"Did you mean {', '.join(repr(h) for h in hints)}?")
            if key in KNOWN_BACKENDS:
                parts.append(f"It is provided by a plugin that is not installed (pip install {KNOWN_BACKENDS[key]}).")
            else:
                missing = sorted({d for k, d in KNOWN_BACKENDS.items() if k not in self._by_name and close_matches(key, [k], cutoff=0.8)})
                for dist in missing:
                    parts.append(f"A close match is provided by a plugin that is not installed (pip install {dist}).")
            unregistered = _installed_without_entry_point(key)
            if unregistered is not None:
                parts.append(
                    f"Distribution {unregistered!r} is installed but declares no entry point in group 'omni_plugins', so it is "
                    "never loaded: add [project.entry-points.omni_plugins] to its pyproject.toml and reinstall it."
                )
        parts.append(f"Available: {', '.join(available) if available else '(none)'}.")
        parts.append("A 'package.module:Class' path loads an unregistered connector; 'omni-plugins list' shows plugins.")
        return ConnectorNotFoundError(" ".join(parts))


def _installed_without_entry_point(key: str) -> str | None:
    """The installed distribution ``omni-plugins-<key>`` (or ``<key>``) when it has no ``omni_plugins`` entry point."""
    import importlib.metadata as md

    for candidate in (f"omni-plugins-{key}", key):
        try:
            dist = md.distribution(candidate.replace("_", "-"))
        except (md.PackageNotFoundError, ValueError):
            continue
        if not any(ep.group == "omni_plugins" for ep in dist.entry_points):
            return str(dist.metadata["Name"])
    return None


class RegistrationSink:
    """What a plugin's ``omni_register_connectors`` hook receives: it stamps each spec with the plugin's identity."""

    def __init__(self, registry: ConnectorRegistry, plugin: str, distribution: str | None, version: str | None) -> None:
        self._registry = registry
        self._plugin = plugin
        self._distribution = distribution
        self._version = version
        self.registered: list[ConnectorSpec] = []

    def register(
        self,
        name: str,
        *,
        connector: str,
        config: str | None = None,
        aliases: Iterable[str] = (),
        description: str = "",
        services: str | None = None,
    ) -> None:
        """Register connector ``name`` implemented by import string ``connector`` ("pkg.mod:Class").

        ``config``: its pydantic settings model; ``services``: its :class:`omni_plugins.services.ConnectorServices`
        subclass (leak census, reclaim, private server, raw baseline, preload). Import strings: nothing is
        imported until used.
        """
        if not isinstance(name, str) or not name.strip() or ":" in name:
            raise ValueError(f"plugin {self._plugin!r}: connector name {name!r} must be a non-empty string without ':'")
        for what, path in (("connector", connector), ("config", config), ("services", services)):
            if path is not None and (not isinstance(path, str) or ":" not in path):
                raise ValueError(f"plugin {self._plugin!r}: {what} of {name!r} must be an import string 'pkg.mod:Name', got {path!r}")
        if isinstance(aliases, str):
            aliases = [aliases]
        spec = ConnectorSpec(
            name=name.strip(),
            connector=connector,
            config=config,
            aliases=tuple(aliases),
            description=description,
            services=services,
            plugin=self._plugin,
            distribution=self._distribution,
            version=self._version,
        )
        self._registry.add(spec)
        self.registered.append(spec)

    def register_vllm_omni(
        self,
        name: str,
        *,
        connector: str | None = None,
        keys: Mapping[str, str] | None = None,
        unused: Mapping[str, str] | None = None,
        translate: str | None = None,
        description: str = "",
    ) -> None:
        """Declare how vLLM-Omni's connector ``name`` reads in omni-plugins (see :class:`VllmOmniName`).

        ``connector``: the omni-plugins connector it becomes, with ``keys`` renaming vLLM-Omni's
        ``extra`` keys to its settings and ``unused`` the vLLM-Omni keys it has no use for (key ->
        why); or ``translate``, an import string of ``f(name, extra) -> (connector, settings)``.
        ``name`` ``"*"``: every vLLM-Omni connector name no plugin declares.
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"plugin {self._plugin!r}: vLLM-Omni connector name {name!r} must be a non-empty string")
        if (connector is None) == (translate is None):
            raise ValueError(f"plugin {self._plugin!r}: vLLM-Omni name {name!r} needs exactly one of connector= and translate=")
        if translate is not None and (not isinstance(translate, str) or ":" not in translate):
            raise ValueError(f"plugin {self._plugin!r}: translate of {name!r} must be an import string 'pkg.mod:func', got {translate!r}")
        for what, table in (("keys", keys or {}), ("unused", unused or {})):
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
                raise ValueError(f"plugin {self._plugin!r}: {what} of vLLM-Omni name {name!r} must map strings to strings")
        self._registry.add_vllm_omni(
            VllmOmniName(
                name=name.strip(),
                connector=connector,
                keys=dict(keys or {}),
                unused=dict(unused or {}),
                translate=translate,
                description=description,
                plugin=self._plugin,
                distribution=self._distribution,
                version=self._version,
            )
        )
