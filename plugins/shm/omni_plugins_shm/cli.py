"""``python -m omni_plugins_shm gc [--namespace NS] [--all [--force]] [--dry-run] [--dir DIR] [--ttl SECONDS]``.

``--all`` refuses (exit status 3, the live instances on stderr) while a live connector instance has a
marker in the namespace(s): it would remove memory they are using. ``--force`` removes it anyway.

The plugin registers :func:`main` as the ``omni-plugins shm`` command (hook ``omni_register_commands``),
so ``omni-plugins shm gc ...`` is the same; :func:`omni_plugins_shm.gc.collect` does the work.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from omni_plugins_shm.expire import collect_expired
from omni_plugins_shm.gc import DEFAULT_SHM_DIR, collect, live_instances


def build_parser(prog: str = "omni-plugins shm") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Maintain the shared-memory connector's segments.")
    sub = parser.add_subparsers(dest="command", required=True)
    gc = sub.add_parser("gc", help="free segments left by dead (crashed) producers and consumers")
    gc.add_argument("--namespace", "-n", default=None, help="only this namespace (default: all omnishm namespaces)")
    gc.add_argument("--all", action="store_true", help="remove everything in the namespace(s) (refused while live instances exist)")
    gc.add_argument("--force", action="store_true", help="with --all: remove it even while live instances use it")
    gc.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    gc.add_argument("--dir", default=DEFAULT_SHM_DIR, help="shm directory (default /dev/shm)")
    gc.add_argument(
        "--ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="also free published payloads of live owners unclaimed for longer than this (age by ctime)",
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "omni-plugins shm") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.command == "gc":
        if args.ttl is not None and args.ttl < 0:
            build_parser(prog).error("--ttl must be >= 0")
        if args.all and not args.force and not args.dry_run:
            live = live_instances(args.namespace, shm_dir=args.dir)
            if live:
                sys.stderr.write(
                    f"gc --all refused: {len(live)} live connector instance(s) use the namespace(s) "
                    f"({', '.join(sorted(live)[:5])}{', ...' if len(live) > 5 else ''}); stop them first, or add --force\n"
                )
                return 3
        report = collect(args.namespace, shm_dir=args.dir, force=args.all, dry_run=args.dry_run)
        if args.ttl is not None and not args.all:
            expired = collect_expired(args.namespace, args.ttl, shm_dir=args.dir, dry_run=args.dry_run)
            gone = set(expired.removed)
            report.removed += expired.removed
            report.kept = [n for n in report.kept if n not in gone]
            report.bytes_freed += expired.bytes_freed
            report.errors += expired.errors
        json.dump({"dry_run": args.dry_run, **report.to_json()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 1 if report.errors else 0
    return 2  # pragma: no cover - argparse enforces the choice


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
