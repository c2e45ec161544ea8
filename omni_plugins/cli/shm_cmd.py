"""``omni-plugins shm ...``: shared-memory maintenance, delegated to the omni-plugins-shm plugin.

``omni-plugins shm gc [--namespace NS] [--all] [--dry-run] [--ttl S]`` reclaims segments
left by crashed producers.
"""

from __future__ import annotations

import argparse
from typing import Any

from omni_plugins.errors import ConnectorNotFoundError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("shm", help="shared-memory maintenance: 'shm gc' (needs omni-plugins-shm)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the shm plugin's CLI (e.g. 'gc --namespace NS')")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        from omni_plugins_shm.cli import main as shm_main
    except ImportError:
        raise ConnectorNotFoundError("the shared-memory plugin is not installed: pip install omni-plugins-shm") from None
    rest = list(args.rest[1:] if args.rest[:1] == ["--"] else args.rest)
    return int(shm_main(rest or ["--help"], prog="omni-plugins shm"))
