"""Render the plugin templates for one connector name into a directory."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from omni_plugins.errors import ConfigError
from omni_plugins.naming import known_distribution
from omni_plugins.scaffold.templates import FILES

_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class PluginNames:
    """Every name derived from the connector name ``name`` (e.g. ``fs-dir``)."""

    name: str  # connector name: fs-dir
    dist: str  # distribution: omni-plugins-fs-dir
    pkg: str  # import package: omni_plugins_fs_dir
    cls: str  # class prefix: FsDir

    def mapping(self) -> dict[str, str]:
        return {"name": self.name, "dist": self.dist, "pkg": self.pkg, "cls": self.cls}


def plugin_names(name: str) -> PluginNames:
    if not _NAME.match(name) or len(name) > 40:
        raise ConfigError(f"plugin name {name!r} must be lowercase letters/digits, words joined by '-', at most 40 chars (e.g. 'fs-dir')")
    owner = known_distribution(name)
    if owner is not None:
        raise ConfigError(
            f"plugin name {name!r} is taken by this project's {owner} (connector or distribution of that name); a generated "
            f"plugin would clash with it. Choose another name, e.g. 'my-{name}'"
        )
    return PluginNames(
        name=name,
        dist=f"omni-plugins-{name}",
        pkg=f"omni_plugins_{name.replace('-', '_')}",
        cls="".join(part.capitalize() for part in name.split("-")),
    )


def generate(name: str, directory: str | Path | None = None, *, force: bool = False) -> tuple[Path, list[Path]]:
    """Write the distribution for ``name`` into ``directory`` (default ``./omni-plugins-<name>``).

    Refuses to overwrite existing files unless ``force``. Returns the directory and the files written.
    A directory that cannot be created or written is a :class:`ConfigError` before any file is written.
    """
    names = plugin_names(name)
    root = Path(directory) if directory is not None else Path.cwd() / names.dist
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root} exists and is not a directory")
    values = names.mapping()
    targets = {root / Template(rel).substitute(values): Template(body).substitute(values) for rel, body in FILES.items()}
    existing = sorted(str(p) for p in targets if p.exists())
    if existing and not force:
        raise ConfigError(f"{len(existing)} file(s) already exist (use --force to overwrite): {', '.join(existing[:3])}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        for path, text in targets.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write the plugin to {root}: {exc.strerror or exc}: {exc.filename or root}") from None
    return root, sorted(targets)
