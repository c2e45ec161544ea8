"""``omni-plugins bench``: each backend's put+get throughput and latency next to its raw baseline."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark connectors against raw backend baselines measured in the same run",
        description="Two processes per backend: the parent puts, a spawned child gets. Servers (redis-server, "
        "mooncake_master) are started on free loopback ports unless an address is given.",
    )
    p.add_argument("--backends", default="shm,redis,mooncake-store,mooncake-te", help="comma-separated (default: all four)")
    p.add_argument("--sizes", default="4KiB,1MiB,64MiB", help="comma-separated payload sizes (default 4KiB,1MiB,64MiB)")
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a plot (matplotlib, Agg)")
    p.add_argument("--quick", action="store_true", help="fewer operations per size")
    p.add_argument("--redis-url", help="use this Redis instead of starting one")
    p.add_argument("--mooncake-master", help="use this mooncake_master (host:port) instead of starting one")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from omni_plugins.bench import BACKENDS, BenchOptions, parse_size, plot, run_bench, write_json
    from omni_plugins.cli.outputs import check_writable, write_failed
    from omni_plugins.errors import ConfigError

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        raise ConfigError(f"--backends needs at least one backend; choose from {', '.join(BACKENDS)}")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not sizes or min(sizes) <= 0:
        raise ConfigError("--sizes needs at least one positive size")
    check_writable(args.json, "--json")
    check_writable(args.plot, "--plot")
    opts = BenchOptions(backends, sizes, args.quick, args.redis_url, args.mooncake_master, progress=not args.no_progress)
    result = run_bench(opts)
    result.command = "omni-plugins " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(result.table())
    for option, path, write in (("--json", args.json, write_json), ("--plot", args.plot if result.results else None, plot)):
        if path:
            try:
                write(result, path)
            except OSError as exc:
                raise write_failed(path, option, exc) from None
    return 0 if result.results else 1
