"""``omni-plugins list``: installed plugin distributions, their connectors, services, commands and status."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("list", help="show installed plugins, their connectors, services and commands")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=run)


def _services(plugin: str) -> dict[str, list[str] | str]:
    """Per connector of ``plugin``: the services its plugin offers, or why they cannot be loaded."""
    from omni_plugins.plugins import get_plugin_manager
    from omni_plugins.services import offered

    out: dict[str, list[str] | str] = {}
    for spec in get_plugin_manager().registry.specs():
        if spec.plugin != plugin:
            continue
        try:
            services = spec.load_services()
        except Exception as exc:
            out[spec.name] = f"error: {exc}"
            continue
        out[spec.name] = list(offered(services)) if services is not None else []
    return out


def run(args: argparse.Namespace) -> int:
    from omni_plugins.factory import plugin_statuses

    statuses = plugin_statuses()
    services = {s.name: _services(s.name) for s in statuses}
    if args.json:
        print(json.dumps([{**s.to_json(), "services": services[s.name]} for s in statuses], indent=2))
        return 0
    rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "STATUS", "CONNECTORS (aliases)")]
    for s in statuses:
        conns = ", ".join(s.connectors) + (f" ({', '.join(s.aliases)})" if s.aliases else "")
        rows.append((s.name, s.distribution or "-", s.version or "-", s.status, conns or "-"))
    _table(rows)
    for s in statuses:
        if s.error:
            print(f"  {s.name}: {s.status}: {s.error}")
    offers = [(name, ", ".join(o) if isinstance(o, list) else o or "-") for per in services.values() for name, o in per.items()]
    if offers:
        print()
        _table([("CONNECTOR", "SERVICES"), *[(n, o or "-") for n, o in sorted(offers)]])
    commands = [(f"omni-plugins {c}", s.name) for s in statuses for c in s.commands]
    if commands:
        print()
        _table([("COMMAND", "PLUGIN"), *commands])
    return 0


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
