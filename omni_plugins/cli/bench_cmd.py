"""``omni-plugins bench``: each backend's put+get throughput and latency next to its raw baseline."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark connectors against raw backend baselines measured in the same run",
        description="Two processes per backend: the parent puts, a spawned child gets; each backend's plugin gives the raw "
        "baseline (the same bytes through the backend without the connector). A backend's private server (e.g. "
        "redis-server) is started on a free loopback port unless its config is given with --config.",
    )
    p.add_argument("--backends", default=None, help="comma-separated connector names (default: every installed one with a raw baseline)")
    p.add_argument("--sizes", default="4KiB,1MiB,64MiB", help="comma-separated payload sizes (default 4KiB,1MiB,64MiB)")
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a plot (matplotlib, Agg)")
    p.add_argument("--quick", action="store_true", help="fewer operations per size")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="BACKEND=JSON",
        help="the backend's connector config (a stage's 'extra', e.g. redis='{\"url\": \"redis://host:6379/0\"}') over the "
        "benchmark's own; no server is started for it (repeatable)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(handler=run)


def _configs(items: list[str]) -> dict[str, dict[str, Any]]:
    from omni_plugins.errors import ConfigError

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            value = json.loads(text) if sep else None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config {item!r}: not JSON: {exc}") from None
        if not name.strip() or not isinstance(value, dict):
            raise ConfigError(f"--config {item!r}: expected BACKEND=JSON-OBJECT, e.g. redis='{{\"url\": \"redis://127.0.0.1:6379/0\"}}'")
        out[name.strip()] = value
    return out


def run(args: argparse.Namespace) -> int:
    from omni_plugins.bench import BenchOptions, backends, parse_size, plot, run_bench, write_json
    from omni_plugins.cli.outputs import check_writable, write_failed
    from omni_plugins.errors import ConfigError
    from omni_plugins.naming import close_matches

    available = backends()
    chosen = available if args.backends is None else [b.strip() for b in args.backends.split(",") if b.strip()]
    if not chosen:
        raise ConfigError(f"--backends needs at least one backend; choose from {', '.join(available) or '(none installed)'}")
    unknown = [b for b in chosen if b not in available]
    if unknown:
        hints = {h for b in unknown for h in close_matches(b, available)}
        raise ConfigError(
            f"unknown backend(s) {unknown}; choose from {', '.join(available) or '(none installed)'} "
            "(installed connectors whose plugin offers a raw baseline)" + (f"; did you mean {', '.join(sorted(hints))}?" if hints else "")
        )
    configs = _configs(args.config)
    stray = sorted(set(configs) - set(chosen))
    if stray:
        raise ConfigError(f"--config for {stray}, which --backends does not include")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not sizes or min(sizes) <= 0:
        raise ConfigError("--sizes needs at least one positive size")
    check_writable(args.json, "--json")
    check_writable(args.plot, "--plot")
    opts = BenchOptions(chosen, sizes, args.quick, configs, progress=not args.no_progress)
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
