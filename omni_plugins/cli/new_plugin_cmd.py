"""``omni-plugins new-plugin NAME``: write a complete connector plugin distribution that passes its own tests."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "new-plugin",
        help="generate a connector plugin distribution (pyproject + entry point, connector, config model, conformance tests)",
    )
    p.add_argument("name", metavar="NAME", help="connector name, e.g. 'fs-dir' (dist omni-plugins-fs-dir, package omni_plugins_fs_dir)")
    p.add_argument("--dir", help="where to write it (default ./omni-plugins-NAME)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from omni_plugins.scaffold import generate, plugin_names

    names = plugin_names(args.name)
    root, files = generate(args.name, args.dir, force=args.force)
    print(f"wrote {names.dist} (connector {names.name!r}, package {names.pkg}) to {root}:")
    for f in files:
        print(f"  {f.relative_to(root)}")
    print("next:")
    print(f"  pip install --no-deps -e {root}")
    print(f"  python -m pytest {root}/tests")
    return 0
