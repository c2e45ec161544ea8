"""``omni-plugins shm gc``: reclaim shared memory left by crashed producers (needs omni-plugins-shm)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from omni_plugins.errors import ConnectorNotFoundError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("shm", help="shared-memory maintenance (omni-plugins-shm)")
    shm_sub = p.add_subparsers(dest="shm_command", metavar="ACTION")
    gc = shm_sub.add_parser("gc", help="remove segments whose producer process is gone")
    gc.add_argument("--namespace", default=None, help="only this namespace (default: all)")
    gc.add_argument("--all", action="store_true", help="also remove segments of live producers in the namespace")
    gc.add_argument("--json", action="store_true")
    gc.set_defaults(handler=run_gc)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def run_gc(args: argparse.Namespace) -> int:
    try:
        from omni_plugins_shm import gc as shm_gc  # type: ignore[import-not-found]
    except ImportError:
        raise ConnectorNotFoundError("the shared-memory plugin is not installed: pip install omni-plugins-shm") from None
    report = shm_gc.collect(namespace=args.namespace, include_live=args.all)
    data = report.to_json() if hasattr(report, "to_json") else report
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(data if isinstance(data, str) else json.dumps(data))
    return 0
