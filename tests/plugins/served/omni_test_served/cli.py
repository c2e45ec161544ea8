"""``omni-plugins served-where --address HOST:PORT``: print the directory the server names."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from omni_test_served.server import ask


def main(argv: Sequence[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Print the directory a served-dir server names.")
    parser.add_argument("--address", required=True)
    args = parser.parse_args(argv)
    print(ask(args.address))
    return 0
