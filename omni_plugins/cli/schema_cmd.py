"""``omni-plugins schema NAME``: the JSON schema of a connector's config model."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("schema", help="print the JSON schema of a connector's config")
    p.add_argument("name", help="connector name or alias")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from omni_plugins.factory import connector_schema

    print(json.dumps(connector_schema(args.name), indent=2))
    return 0
