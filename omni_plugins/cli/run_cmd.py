"""``omni-plugins run PIPELINE.yaml``: run a pipeline of synthetic stages and check every payload.

On one machine it runs every stage. Across machines each runs its share of the
same YAML: the coordinating host (``--serve ADDR``, or the ``placement``'s
coordinator) serves the control channel and feeds the requests, every other
host (``--join ADDR``) runs its stages and follows
(:mod:`omni_plugins.pipeline.hosts`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from omni_plugins.errors import ConfigError

LOOPBACK_SERVERS = "--start-servers starts servers on this machine's loopback only; across hosts, start the backends' servers yourself"


def positive_seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds above 0 (``-1``, ``0``, ``nan``, ``inf`` would disable or break it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text!r}")
    return value


def stage_list(text: str) -> tuple[int, ...]:
    """``--stages 1,2``: stage ids, comma-separated."""
    try:
        ids = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected stage ids separated by commas (e.g. 1,2), got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("name at least one stage")
    return ids


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free one) to 65535, got {value}")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a pipeline of synthetic stages over its connectors; verify every payload, report throughput and latency",
        description="One process per stage (and TP rank). Exit status 0 only when every request completed, every payload "
        "matched, and no stage, runtime or backend leaked anything. Across machines, run the same YAML on each with "
        "--host NAME (a 'placement' section) or --stages and --serve / --join; the shared secret comes from "
        "$OMNI_CONTROL_SECRET or --secret-file.",
    )
    p.add_argument("pipeline", metavar="PIPELINE.yaml")
    p.add_argument("--requests", "-n", type=int, default=16, metavar="N", help="requests to run (default 16; on the coordinating host)")
    p.add_argument(
        "--concurrency", "-c", type=int, default=4, metavar="C", help="requests in flight at once (default 4; on the coordinating host)"
    )
    p.add_argument(
        "--report", metavar="FILE.json", help="write the full report as JSON (a joining host: what it saw and the run's outcome)"
    )
    p.add_argument(
        "--start-servers",
        action="store_true",
        help="start the private servers the pipeline's backends need (each plugin's own, e.g. redis-server) on free "
        "loopback ports, set the variables the YAML reads their addresses from (e.g. OMNI_REDIS_URL), stop them afterwards",
    )
    p.add_argument("--timeout", type=positive_seconds, default=600.0, metavar="S", help="give up after S seconds (default 600)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--platform", metavar="NAME", help="vLLM-Omni files: apply their platforms section for this platform (npu, rocm, xpu ...); without it, platform sections are not applied")
    hosts = p.add_argument_group("across hosts")
    hosts.add_argument("--host", metavar="NAME", help="this machine's name: one of the placement's hosts (default: the hostname)")
    hosts.add_argument("--stages", type=stage_list, metavar="IDS", help="the stages this machine runs, e.g. 1,2 (default: the placement's)")
    hosts.add_argument("--serve", metavar="ADDR", help="coordinate: serve the control channel on HOST:PORT (default: placement.control)")
    hosts.add_argument(
        "--join", metavar="ADDR", help="join the coordinating host's control channel at HOST:PORT (default: placement.control)"
    )
    hosts.add_argument("--secret-file", metavar="FILE", help="the shared control secret (default: $OMNI_CONTROL_SECRET); at least 16 bytes")
    hosts.add_argument(
        "--host-timeout", type=positive_seconds, default=30.0, metavar="S", help="a host silent for S seconds is lost (default 30)"
    )
    metrics = p.add_argument_group("metrics")
    metrics.add_argument(
        "--metrics-port",
        type=port_number,
        metavar="PORT",
        help="serve every stage process's Prometheus metrics of this machine, merged, on http://HOST:PORT/metrics (0: any free port)",
    )
    metrics.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="address to serve metrics on (default 127.0.0.1)")
    metrics.add_argument(
        "--metrics-linger",
        type=float,
        default=0.0,
        metavar="S",
        help="after the report, keep serving the final metrics for S seconds (Ctrl-C ends it), so a scrape sees the last counts",
    )
    p.set_defaults(handler=run)


@dataclass(frozen=True)
class Role:
    """What this machine does in the run: everything alone, coordinate, or join."""

    kind: str  # "alone", "coordinate", "join"
    host: str = ""
    stages: tuple[int, ...] = ()
    address: str = ""  # where to serve, or whom to join
    expected: dict[str, list[int]] | None = None


def resolve_role(args: argparse.Namespace, config: Any) -> Role:
    """The role from the command line and the YAML's ``placement`` (errors name the option to fix)."""
    placement = config.placement
    across = any(getattr(args, name) is not None for name in ("host", "stages", "serve", "join"))
    if placement is None and not across:
        return Role("alone")
    if args.serve is not None and args.join is not None:
        raise ConfigError("--serve and --join: a machine either coordinates (--serve) or joins (--join)")
    if placement is None:
        if args.stages is None or (args.serve is None and args.join is None):
            raise ConfigError(
                "to run part of a pipeline, name this machine's stages (--stages 1,2) and either coordinate (--serve HOST:PORT) "
                "or join the coordinating machine (--join HOST:PORT); or add a 'placement' section to the YAML"
            )
        host = args.host or socket.gethostname()
        if args.serve is not None:
            return Role("coordinate", host, args.stages, args.serve)
        return Role("join", host, args.stages, args.join)
    names = ", ".join(placement.hosts)
    if args.host is None:
        raise ConfigError(f"{args.pipeline} places its stages on hosts {names}: say which one this is (--host NAME)")
    if args.host not in placement.hosts:
        raise ConfigError(f"--host {args.host}: {args.pipeline}'s placement has hosts {names}")
    stages = tuple(sorted(placement.hosts[args.host]))
    if args.stages is not None and args.stages != stages:
        raise ConfigError(
            f"--stages {','.join(map(str, args.stages))}: the placement gives host {args.host} stage(s) {','.join(map(str, stages))}"
        )
    coordinator = placement.coordinating_host
    if args.host == coordinator:
        if args.join is not None:
            raise ConfigError(f"host {args.host} coordinates this pipeline (placement.coordinator): it serves (--serve), it does not join")
        address = args.serve or placement.control
        if address is None:
            raise ConfigError(
                f"host {args.host} coordinates: give the address to serve the control channel on (--serve HOST:PORT or placement.control)"
            )
        expected = {name: list(ids) for name, ids in placement.hosts.items() if name != coordinator}
        return Role("coordinate", args.host, stages, address, expected)
    if args.serve is not None:
        raise ConfigError(
            f"host {coordinator} coordinates this pipeline (placement); host {args.host} joins it (--join), it does not serve"
        )
    address = args.join or placement.control
    if address is None:
        raise ConfigError(
            f"host {args.host} joins host {coordinator}: give its control channel's address (--join HOST:PORT or placement.control)"
        )
    return Role("join", args.host, stages, address)


def run(args: argparse.Namespace) -> int:
    from omni_plugins.cli.outputs import check_writable, write_failed
    from omni_plugins.config import load_pipeline_config
    from omni_plugins.pipeline.servers import PrivateServers, connector_names

    if args.requests < 1 or args.concurrency < 1:
        raise ConfigError("--requests and --concurrency must be at least 1")
    if not math.isfinite(args.metrics_linger) or args.metrics_linger < 0:
        raise ConfigError(f"--metrics-linger must be 0 or more seconds, got {args.metrics_linger}")
    check_writable(args.report, "--report")
    if args.metrics_port is not None:
        from omni_plugins.metrics import require_prometheus

        require_prometheus()
    if args.start_servers and any(getattr(args, name) is not None for name in ("host", "stages", "serve", "join")):
        raise ConfigError(LOOPBACK_SERVERS)
    with PrivateServers() as servers:
        if args.start_servers:  # before the YAML is read: it may read the servers' addresses from variables they set
            servers.start_for(connector_names(args.pipeline, platform=args.platform))
            for line in servers.descriptions:
                print(f"started {line}", file=sys.stderr)
        role = resolve_role(args, load_pipeline_config(args.pipeline, platform=args.platform))
        if role.kind != "alone" and args.start_servers:
            raise ConfigError(LOOPBACK_SERVERS)
        if role.kind == "join":
            return _join(args, role)
        orchestrator = _orchestrator(args, role)
        try:
            report = orchestrator.run()
            report.servers = list(servers.descriptions)
            print(report.table())
            if args.report:
                try:
                    report.write_json(args.report)
                except OSError as exc:
                    raise write_failed(args.report, "--report", exc) from None
            _linger(args)
        finally:
            orchestrator.close_metrics()
    return 0 if report.ok else 1


def _options(args: argparse.Namespace) -> Any:
    from omni_plugins.pipeline import RunOptions

    return RunOptions(
        requests=args.requests,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        progress=not args.no_progress,
        log_level=logging.getLogger().getEffectiveLevel(),
        platform=args.platform,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        host_timeout_s=args.host_timeout,
    )


def _orchestrator(args: argparse.Namespace, role: Role) -> Any:
    from omni_plugins.pipeline.launcher import Coordination, prepare

    coordination = None
    if role.kind == "coordinate":
        from omni_plugins.pipeline.control import load_secret, pipeline_digest

        coordination = Coordination(
            role.host, role.stages, role.address, load_secret(args.secret_file), pipeline_digest(args.pipeline), role.expected
        )
    return prepare(args.pipeline, _options(args), coordination)


def _join(args: argparse.Namespace, role: Role) -> int:
    from omni_plugins.cli.outputs import write_failed
    from omni_plugins.pipeline.agent import HostAgent, JoinOptions
    from omni_plugins.pipeline.control import load_secret

    options = JoinOptions(
        host=role.host,
        stages=role.stages,
        join=role.address,
        secret=load_secret(args.secret_file),
        host_timeout_s=args.host_timeout,
        log_level=logging.getLogger().getEffectiveLevel(),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        platform=args.platform,
    )
    agent = HostAgent(args.pipeline, options)
    try:
        outcome = agent.run()
        if outcome.table:
            print(outcome.table)
        for title, items in (("problem", outcome.problems), ("leak", outcome.leaks), ("reclaimed", outcome.reclaimed)):
            for item in items:
                print(f"  host {role.host}: {title}: {item}")
        if args.report:
            data = {"host": role.host, "stages": list(role.stages), "ok": outcome.ok and not outcome.problems and not outcome.leaks}
            data.update(problems=outcome.problems, leaks=outcome.leaks, reclaimed=outcome.reclaimed, report=outcome.table)
            try:
                with open(args.report, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=2)
                    f.write("\n")
            except OSError as exc:
                raise write_failed(args.report, "--report", exc) from None
        _linger(args)
    finally:
        agent.close_metrics()
    return 0 if outcome.ok and not outcome.problems and not outcome.leaks else 1


def _linger(args: argparse.Namespace) -> None:
    if args.metrics_port is None or args.metrics_linger <= 0:
        return
    print(f"omni-plugins: serving the final metrics for {args.metrics_linger:g} s (Ctrl-C ends it)", file=sys.stderr)
    try:
        time.sleep(args.metrics_linger)
    except KeyboardInterrupt:
        pass
