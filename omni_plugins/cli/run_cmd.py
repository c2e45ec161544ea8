"""``omni-plugins run PIPELINE.yaml``: run a pipeline of synthetic stages and check every payload."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any


def positive_seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds above 0 (``-1``, ``0``, ``nan``, ``inf`` would disable or break it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text!r}")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a pipeline of synthetic stages over its connectors; verify every payload, report throughput and latency",
        description="One process per stage (and TP rank). Exit status 0 only when every request completed, every payload "
        "matched, and no stage, runtime or backend leaked anything.",
    )
    p.add_argument("pipeline", metavar="PIPELINE.yaml")
    p.add_argument("--requests", "-n", type=int, default=16, metavar="N", help="requests to run (default 16)")
    p.add_argument("--concurrency", "-c", type=int, default=4, metavar="C", help="requests in flight at once (default 4)")
    p.add_argument("--report", metavar="FILE.json", help="write the full report as JSON")
    p.add_argument(
        "--start-servers",
        action="store_true",
        help="start the private servers the pipeline's backends need (each plugin's own, e.g. redis-server) on free "
        "loopback ports, set the variables the YAML reads their addresses from (e.g. OMNI_REDIS_URL), stop them afterwards",
    )
    p.add_argument("--timeout", type=positive_seconds, default=600.0, metavar="S", help="give up after S seconds (default 600)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--platform", metavar="NAME", help="vLLM-Omni files: apply their platforms section for this platform (npu, rocm, xpu ...); without it, platform sections are not applied")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from omni_plugins.cli.outputs import check_writable, write_failed
    from omni_plugins.errors import ConfigError
    from omni_plugins.pipeline import RunOptions, run_pipeline
    from omni_plugins.pipeline.servers import PrivateServers, connector_names

    if args.requests < 1 or args.concurrency < 1:
        raise ConfigError("--requests and --concurrency must be at least 1")
    check_writable(args.report, "--report")
    options = RunOptions(
        requests=args.requests,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        progress=not args.no_progress,
        log_level=logging.getLogger().getEffectiveLevel(),
        platform=args.platform,
    )
    with PrivateServers() as servers:
        if args.start_servers:
            servers.start_for(connector_names(args.pipeline, platform=args.platform))
            for line in servers.descriptions:
                print(f"started {line}", file=sys.stderr)
        report = run_pipeline(args.pipeline, options)
        report.servers = list(servers.descriptions)
    print(report.table())
    if args.report:
        try:
            report.write_json(args.report)
        except OSError as exc:
            raise write_failed(args.report, "--report", exc) from None
    return 0 if report.ok else 1
