"""Plugin discovery: entry points -> pluggy -> the connector registry.

Our own loading loop rather than ``pluggy.load_setuptools_entrypoints`` so that
the allow-list applies before anything is imported, each plugin is loaded in
isolation, and one broken plugin is recorded (and shown by ``omni-plugins
list``) instead of taking the whole tool down.

Environment:
    OMNI_PLUGINS          comma list of plugin (entry-point) or distribution names
                          to load; unset = all, empty string = none.
    OMNI_PLUGINS_DISABLE  comma list of plugins not to load.
    OMNI_PLUGINS_STRICT   "1" raises PluginLoadError on the first failure.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy

from omni_plugins import hookspecs
from omni_plugins.commands import CommandSink, CommandTable
from omni_plugins.errors import PluginLoadError
from omni_plugins.naming import canonical
from omni_plugins.registry import ConnectorRegistry, RegistrationSink

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "omni_plugins"
BUILTIN_PLUGINS: tuple[str, ...] = ("omni_plugins.builtin",)

Status = Literal["loaded", "blocked", "disabled", "failed"]


@dataclass
class PluginStatus:
    """What happened to one plugin at load time (shown by ``omni-plugins list``)."""

    name: str
    distribution: str | None
    version: str | None
    status: Status
    connectors: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "connectors": self.connectors,
            "aliases": self.aliases,
            "commands": self.commands,
            "error": self.error,
        }


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {canonical(x) for x in raw.split(",") if x.strip()}


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line; a multi-line message (pluggy's validation errors) keeps every line, joined."""
    text = " / ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    if len(text) > 500:
        text = text[:497] + "..."
    return f"{type(exc).__name__}: {text}".rstrip(": ")


def _no_hook_hint(plugin: object) -> str:
    """Why a plugin object has no hook implementation: an undecorated or misspelled function nearby, if any."""
    import difflib

    hook = "omni_register_connectors"
    names = [n for n in dir(plugin) if not n.startswith("__") and callable(getattr(plugin, n, None))]
    if hook in names:
        return f"; it defines {hook}() without the @omni_plugins.hookimpl decorator"
    close = difflib.get_close_matches(hook, names, n=1, cutoff=0.75)
    if close:
        return f"; it defines {close[0]}(): a misspelling of {hook}, and without @omni_plugins.hookimpl?"
    return ""


class PluginManager:
    """Owns a pluggy manager, the connector registry and per-plugin load statuses.

    ``load()`` is idempotent; ``autoload=False`` gives an isolated manager that
    only sees plugins registered explicitly (used by the testing kit).
    """

    def __init__(self, *, autoload: bool = True, builtins: bool = True) -> None:
        self.autoload = autoload
        self.builtins = builtins
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.registry = ConnectorRegistry()
        self.commands = CommandTable()
        self.statuses: dict[str, PluginStatus] = {}
        self._loaded = False
        self._lock = threading.RLock()
        self._warned: set[str] = set()

    # -- loading -----------------------------------------------------------
    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if self.builtins:
                for module_name in BUILTIN_PLUGINS:
                    self._load_one(
                        module_name, lambda m=module_name: __import__(m, fromlist=["_"]), "omni-plugins", _version("omni-plugins")
                    )
            if self.autoload:
                self._load_entry_points()

    def _load_entry_points(self) -> None:
        strict = os.environ.get("OMNI_PLUGINS_STRICT", "") not in ("", "0", "false", "no")
        allow = _env_list("OMNI_PLUGINS")
        deny = _env_list("OMNI_PLUGINS_DISABLE") or set()
        seen: set[tuple[str, str | None]] = set()
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            if (ep.name, dist) in seen:
                continue
            seen.add((ep.name, dist))
            ids = {canonical(ep.name)} | ({canonical(dist)} if dist else set())
            if allow is not None and not ids & allow:
                self.statuses[ep.name] = PluginStatus(ep.name, dist, version, "blocked", error="not in OMNI_PLUGINS")
                self.registry.note_skipped(ep.name, dist, f"not loaded: it is not in OMNI_PLUGINS={os.environ.get('OMNI_PLUGINS', '')!r}")
                continue
            if ids & deny:
                self.statuses[ep.name] = PluginStatus(ep.name, dist, version, "disabled", error="in OMNI_PLUGINS_DISABLE")
                self.registry.note_skipped(ep.name, dist, "disabled by OMNI_PLUGINS_DISABLE")
                continue
            status = self._load_one(ep.name, ep.load, dist, version)
            if status.status == "failed" and strict:
                raise PluginLoadError(f"plugin {ep.name!r} from {dist} {version} failed to load: {status.error}") from status.exception

    def _load_one(self, name: str, loader: Any, dist: str | None, version: str | None) -> PluginStatus:
        """Import, register and run one plugin's hook; any failure is recorded, not raised."""
        try:
            module = loader()
            if self.pm.is_registered(module) or self.pm.has_plugin(name):
                status = self.statuses.get(name) or PluginStatus(name, dist, version, "loaded")
                return status
            status = self.register(module, name=name, distribution=dist, version=version)
        except Exception as exc:
            status = self._failed(name, dist, version, exc)
        return status

    def register(
        self, plugin: object, *, name: str | None = None, distribution: str | None = None, version: str | None = None
    ) -> PluginStatus:
        """Register a plugin object (module or instance with hookimpls) and collect its connectors."""
        with self._lock:
            plugin_name = name or getattr(plugin, "__name__", None) or repr(plugin)
            try:
                self.pm.register(plugin, name=plugin_name)
            except (ValueError, pluggy.PluginValidationError) as exc:  # already registered under this name; a hookimpl not matching the spec
                return self._failed(plugin_name, distribution, version, exc)
            try:
                self.pm.check_pending()
                sink = RegistrationSink(self.registry, plugin_name, distribution, version)
                commands = CommandSink(self.commands, plugin_name, distribution)
                connector_impls = self._impls("omni_register_connectors", plugin_name)
                command_impls = self._impls("omni_register_commands", plugin_name)
                if not connector_impls and not command_impls:
                    raise PluginLoadError(
                        f"plugin {plugin_name!r} has no @hookimpl omni_register_connectors(registry), so it registers no connector"
                        + _no_hook_hint(plugin)
                    )
                for impl in connector_impls:
                    _call_hook(impl, plugin_name, "registry", sink, "call registry.register(name, connector=..., config=...)")
                if connector_impls and not sink.registered:
                    raise PluginLoadError(
                        f"plugin {plugin_name!r}: omni_register_connectors registered no connector "
                        "(call registry.register(name, connector=..., config=...))"
                    )
                for impl in command_impls:
                    _call_hook(impl, plugin_name, "commands", commands, "call commands.register(name, main=..., help=...)")
            except Exception as exc:
                self.registry.remove_plugin(plugin_name)
                self.commands.remove_plugin(plugin_name)
                self.pm.unregister(name=plugin_name)
                return self._failed(plugin_name, distribution, version, exc)
            status = PluginStatus(
                plugin_name,
                distribution,
                version,
                "loaded",
                connectors=[s.name for s in sink.registered],
                aliases=[a for s in sink.registered for a in s.aliases],
                commands=[c.name for c in commands.registered],
            )
            self.statuses[plugin_name] = status
            return status

    def _impls(self, hook: str, plugin_name: str) -> list[Any]:
        return [i for i in getattr(self.pm.hook, hook).get_hookimpls() if i.plugin_name == plugin_name]

    def unregister(self, plugin_name: str) -> None:
        with self._lock:
            if self.pm.has_plugin(plugin_name):
                self.pm.unregister(name=plugin_name)
            self.registry.remove_plugin(plugin_name)
            self.commands.remove_plugin(plugin_name)
            self.statuses.pop(plugin_name, None)

    def _failed(self, name: str, dist: str | None, version: str | None, exc: BaseException) -> PluginStatus:
        status = PluginStatus(name, dist, version, "failed", error=_one_line(exc), exception=exc)
        self.statuses[name] = status
        self.registry.note_failed(name, exc, provides=[name])
        if dist:
            self.registry.note_failed(dist, exc, provides=[dist, dist.removeprefix("omni-plugins-")])
        if name not in self._warned:
            self._warned.add(name)
            log.warning("plugin %r (%s %s) failed to load: %s", name, dist or "?", version or "", status.error)
        return status

    def plugin_statuses(self) -> list[PluginStatus]:
        self.load()
        return sorted(self.statuses.values(), key=lambda s: (s.distribution or "", s.name))


def _call_hook(impl: Any, plugin_name: str, argname: str, sink: object, how: str) -> None:
    returned = impl.function(**({argname: sink} if argname in impl.argnames else {}))
    if returned is not None:
        raise PluginLoadError(
            f"plugin {plugin_name!r}: {impl.function.__name__} returned {type(returned).__name__} {returned!r:.80}; "
            f"a return value is ignored: {how} and return None"
        )


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


_default: PluginManager | None = None
_default_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, loaded on first use (idempotent; loaded in every process that asks)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PluginManager()
        manager = _default
    manager.load()
    return manager


def set_plugin_manager(manager: PluginManager | None) -> PluginManager | None:
    """Swap the process-wide manager (the testing kit uses this); returns the previous one."""
    global _default
    with _default_lock:
        previous, _default = _default, manager
    return previous
