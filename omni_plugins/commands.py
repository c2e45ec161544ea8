"""Subcommands plugins add to the ``omni-plugins`` CLI (hook ``omni_register_commands``).

A plugin registers a name, an import string of its entry function and a help line::

    @hookimpl
    def omni_register_commands(commands: CommandSink) -> None:
        commands.register("shm", main="omni_plugins_shm.cli:main", help="shared-memory maintenance")

``omni-plugins shm gc --dry-run`` then calls ``main(["gc", "--dry-run"], prog="omni-plugins shm")``:
the plugin owns everything after its name (its own parser, its ``--help``), and nothing of it
is imported until the command runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from omni_plugins.errors import PluginLoadError
from omni_plugins.importing import import_string

#: the core's own subcommands: no plugin may take these names
CORE_COMMANDS: frozenset[str] = frozenset({"list", "validate", "schema", "run", "bench", "new-plugin"})


class CommandMain(Protocol):
    """A plugin command's entry: the arguments after its name and the program name for usage lines; returns the exit status."""

    def __call__(self, argv: Sequence[str], prog: str) -> int: ...


@dataclass(frozen=True)
class CommandSpec:
    """One registered subcommand and the plugin that provides it."""

    name: str
    main: str
    help: str = ""
    plugin: str = ""
    distribution: str | None = None

    def load(self) -> CommandMain:
        try:
            fn = import_string(self.main)
        except ImportError as exc:
            raise PluginLoadError(f"command {self.name!r} (plugin {self.plugin!r}) cannot be imported from {self.main!r}: {exc}") from exc
        if not callable(fn):
            raise PluginLoadError(f"command {self.name!r} (plugin {self.plugin!r}): {self.main!r} is not callable")
        command: CommandMain = fn
        return command


@dataclass
class CommandTable:
    """Every plugin command by name."""

    _by_name: dict[str, CommandSpec] = field(default_factory=dict)

    def add(self, spec: CommandSpec) -> None:
        other = self._by_name.get(spec.name)
        if other is not None and other.plugin != spec.plugin:
            raise ValueError(f"command {spec.name!r} is already provided by plugin {other.plugin!r} ({other.distribution})")
        self._by_name[spec.name] = spec

    def remove_plugin(self, plugin: str) -> None:
        self._by_name = {n: s for n, s in self._by_name.items() if s.plugin != plugin}

    def get(self, name: str) -> CommandSpec | None:
        return self._by_name.get(name)

    def specs(self) -> list[CommandSpec]:
        return sorted(self._by_name.values(), key=lambda s: s.name)


class CommandSink:
    """What a plugin's ``omni_register_commands`` hook receives: it stamps each command with the plugin's identity."""

    def __init__(self, table: CommandTable, plugin: str, distribution: str | None) -> None:
        self._table = table
        self._plugin = plugin
        self._distribution = distribution
        self.registered: list[CommandSpec] = []

    def register(self, name: str, *, main: str, help: str = "") -> None:
        """Add ``omni-plugins NAME ...``, run by ``main`` (import string of a :class:`CommandMain`)."""
        if not isinstance(name, str) or not name or not all(c.isalnum() or c == "-" for c in name) or name.startswith("-"):
            raise ValueError(f"plugin {self._plugin!r}: command name {name!r} must be letters, digits and '-'")
        if name in CORE_COMMANDS:
            raise ValueError(f"plugin {self._plugin!r}: command name {name!r} is one of omni-plugins' own ({', '.join(sorted(CORE_COMMANDS))})")
        if not isinstance(main, str) or ":" not in main:
            raise ValueError(f"plugin {self._plugin!r}: main of command {name!r} must be an import string 'pkg.mod:function', got {main!r}")
        spec = CommandSpec(name, main, help, self._plugin, self._distribution)
        self._table.add(spec)
        self.registered.append(spec)
