"""``omni-plugins list``: installed plugin distributions, their connectors and status."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("list", help="show installed plugins and their connectors")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from omni_plugins.factory import plugin_statuses

    statuses = plugin_statuses()
    if args.json:
        print(json.dumps([s.to_json() for s in statuses], indent=2))
        return 0
    rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "STATUS", "CONNECTORS (aliases)")]
    for s in statuses:
        conns = ", ".join(s.connectors) + (f" ({', '.join(s.aliases)})" if s.aliases else "")
        rows.append((s.name, s.distribution or "-", s.version or "-", s.status, conns or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=False)) + "  " + r[4])
    for s in statuses:
        if s.error:
            print(f"  {s.name}: {s.status}: {s.error}")
    return 0
