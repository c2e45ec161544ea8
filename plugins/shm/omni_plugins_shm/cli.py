"""``python -m omni_plugins_shm gc [--namespace NS] [--all] [--dry-run] [--dir DIR]``.

The core ``omni-plugins`` CLI can expose the same as ``omni-plugins shm gc`` by calling
:func:`main` with the arguments after ``shm`` (or :func:`omni_plugins_shm.gc.collect` directly).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from omni_plugins_shm.gc import DEFAULT_SHM_DIR, collect


def build_parser(prog: str = "omni-plugins shm") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Maintain the shared-memory connector's segments.")
    sub = parser.add_subparsers(dest="command", required=True)
    gc = sub.add_parser("gc", help="free segments left by dead (crashed) producers and consumers")
    gc.add_argument("--namespace", "-n", default=None, help="only this namespace (default: all omnishm namespaces)")
    gc.add_argument("--all", action="store_true", help="remove everything in the namespace(s), live or not")
    gc.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    gc.add_argument("--dir", default=DEFAULT_SHM_DIR, help="shm directory (default /dev/shm)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "omni-plugins shm") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.command == "gc":
        report = collect(args.namespace, shm_dir=args.dir, force=args.all, dry_run=args.dry_run)
        json.dump({"dry_run": args.dry_run, **report.to_json()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 1 if report.errors else 0
    return 2  # pragma: no cover - argparse enforces the choice


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
