"""``omni-plugins bench``: connectors against their raw baselines, the runtime under load, targets checked."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark connectors against raw baselines and the runtime against the connector alone, in the same run",
        description="Producer and consumer in separate processes, each with its own connections. Sections: 'sizes' (every "
        "backend against its plugin's raw baseline, 4KiB to 256MiB), 'load' (the runtime's hand-off latency and delivered "
        "throughput under rising load, against the connector alone and a hand-off floor under the same traffic), 'scaling' "
        "(the runtime's CPU "
        "per chunk and memory per in-flight request, 16 to 1024 streams), 'topology' (fan-out and fan-in against a chain), "
        "'peer' (vLLM-Omni's own connector and runtime, "
        "in its integration venv). Every target is checked and written to the JSON. A backend's private server (e.g. "
        "redis-server) is started on a free loopback port unless its config is given with --config.",
    )
    p.add_argument(
        "--sections", default="sizes", help="comma-separated: sizes, load, scaling, topology, peer, or all but peer: all (default: sizes)"
    )
    p.add_argument("--backends", default=None, help="comma-separated connector names (default: every installed one with a raw baseline)")
    p.add_argument("--sizes", default=None, help="comma-separated payload sizes (default 4KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB)")
    p.add_argument(
        "--runtime-backend",
        default=None,
        help="the connector the load, scaling and peer sections run the runtime over (default: the first local one, e.g. shm)",
    )
    p.add_argument("--streams", type=int, default=None, help="load: concurrent streams (default 64)")
    p.add_argument("--chunk", default=None, help="load: chunk size (default 64KiB)")
    p.add_argument("--intervals-ms", default=None, help="load: a chunk per stream every ... ms, light to heavy (default 32,16,8,4,2,1,0.5,0.25)")
    p.add_argument("--seconds", type=float, default=None, help="load: seconds per point, mode and round (default 1.0)")
    p.add_argument("--rounds", type=int, default=None, help="load, scaling, topology: rounds, modes interleaved in each (default 3)")
    p.add_argument("--scaling-streams", default=None, help="scaling: stream counts (default 16,64,256,1024)")
    p.add_argument(
        "--tuning",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="load: also measure the runtime with these RuntimeTuning fields, as mode runtime:NAME in the same run (A/B; "
        "repeatable), e.g. noanticipate='{\"anticipate_s\": 0}'",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="BACKEND:NAME=JSON",
        help="sizes: also measure BACKEND's connector with this config overlay on the benchmark's config, as variant NAME "
        "interleaved with the others in the same run (A/B; repeatable; the overlay shares what it does not set, such as "
        'a namespace), e.g. shm:nofiles=\'{"namespace": "bench-nofiles", "slot_count": 0}\'',
    )
    p.add_argument("--json", metavar="FILE", help="write the results document (one JSON format for every section)")
    p.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib: pip install 'omni-plugins[plot]')")
    p.add_argument("--quick", action="store_true", help="a short run that checks the harness (its document says so)")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="BACKEND=JSON",
        help="the backend's connector config (a stage's 'extra', e.g. redis='{\"url\": \"redis://host:6379/0\"}') over the "
        "benchmark's own; no server is started for it (repeatable)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


def _configs(items: list[str], option: str = "--config") -> dict[str, dict[str, Any]]:
    from omni_plugins.errors import ConfigError

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            value = json.loads(text) if sep else None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{option} {item!r}: not JSON: {exc}") from None
        if not name.strip() or not isinstance(value, dict):
            raise ConfigError(
                f"{option} {item!r}: expected NAME=JSON-OBJECT, e.g. "
                + ('redis=\'{"url": "redis://127.0.0.1:6379/0"}\'' if option == "--config" else "noanticipate='{\"anticipate_s\": 0}'")
            )
        out[name.strip()] = value
    return out


def _variants(items: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """``--variant BACKEND:NAME=JSON`` items as backend -> variant name -> config overlay."""
    from omni_plugins.errors import ConfigError

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for item in items:
        target, sep, _ = item.partition("=")
        backend, colon, name = target.partition(":")
        if not (sep and colon and backend.strip() and name.strip()):
            raise ConfigError(f"--variant {item!r}: expected BACKEND:NAME=JSON-OBJECT, e.g. shm:nofiles='{{\"slot_count\": 0}}'")
        overlay = _configs([f"{name.strip()}={item.partition('=')[2]}"], "--variant")
        out.setdefault(backend.strip(), {}).update(overlay)
    return out


def _names(text: str | None, available: list[str], option: str, what: str, noun: str = "backend") -> list[str] | None:
    from omni_plugins.errors import ConfigError
    from omni_plugins.naming import close_matches

    if text is None:
        return None
    chosen = [b.strip() for b in text.split(",") if b.strip()]
    if not chosen:
        raise ConfigError(f"{option} needs at least one {noun}; choose from {', '.join(available) or '(none installed)'}")
    unknown = [b for b in chosen if b not in available]
    if unknown:
        hints = {h for b in unknown for h in close_matches(b, available)}
        raise ConfigError(
            f"{option}: unknown {unknown}; choose from {', '.join(available) or '(none installed)'} ({what})"
            + (f"; did you mean {', '.join(sorted(hints))}?" if hints else "")
        )
    return chosen


def options(args: argparse.Namespace) -> Any:
    """The run's options from the command line, every check made before anything is measured."""
    from omni_plugins.bench import SECTIONS, BenchOptions, backends, local_backends, parse_sizes
    from omni_plugins.bench.runner import DEFAULT_SIZES, QUICK_SIZES
    from omni_plugins.errors import ConfigError

    # 'all' leaves the peer out: it runs in vLLM-Omni's venv (--sections peer)
    sections = (
        [s for s in SECTIONS if s != "peer"]
        if args.sections.strip() == "all"
        else _names(args.sections, list(SECTIONS), "--sections", "sections", "section")
    )
    assert sections is not None
    available = backends()
    chosen = _names(args.backends, available, "--backends", "installed connectors whose plugin offers a raw baseline")
    runtime = None
    if {"load", "scaling", "topology", "peer"} & set(sections):
        runtime_choice = _names(args.runtime_backend, available, "--runtime-backend", "installed bench backends")
        local = local_backends()
        runtime = runtime_choice[0] if runtime_choice else (local[0] if local else None)
        if runtime is None:
            raise ConfigError(
                "the load, scaling and peer sections need a local cross-process backend (pip install omni-plugins-shm) or --runtime-backend"
            )
    configs = _configs(args.config)
    stray = sorted(set(configs) - set(chosen or available) - {runtime})
    if stray:
        raise ConfigError(f"--config for {stray}, which this run does not measure")
    variants = _variants(args.variant)
    stray = sorted(set(variants) - set(chosen or available)) if "sizes" in sections else sorted(variants)
    if stray:
        raise ConfigError(f"--variant for {stray}, whose size curve this run does not measure")
    try:
        sizes = parse_sizes(args.sizes) if args.sizes else list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    except ValueError as exc:
        raise ConfigError(f"--sizes: {exc}") from None
    opts = BenchOptions(
        sections=sections,
        backends=chosen if chosen is not None else available,
        sizes=sizes,
        quick=args.quick,
        configs=configs,
        variants=variants,
        progress=not args.no_progress,
        runtime_backend=runtime,
    )
    if runtime is not None:
        from omni_plugins.bench.load import load_options

        try:
            opts.load = load_options(
                args.streams, args.chunk, args.intervals_ms, args.scaling_streams, args.quick, _configs(args.tuning, "--tuning")
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return opts


def run(args: argparse.Namespace) -> int:
    from omni_plugins.bench import report, run_bench
    from omni_plugins.bench.plot import missing_extra, plot
    from omni_plugins.cli.outputs import check_writable, write_failed
    from omni_plugins.errors import ConfigError

    opts = options(args)
    if args.plot and (why := missing_extra()) is not None:
        raise ConfigError(why)
    if "peer" in opts.sections:
        from omni_plugins.bench.peer import missing_peer

        if (why := missing_peer()) is not None:
            raise ConfigError(why)
    check_writable(args.json, "--json")
    check_writable(args.plot, "--plot")
    command = "omni-plugins " + " ".join(shlex.quote(a) for a in getattr(args, "argv", sys.argv[1:]))
    doc = run_bench(opts, command)
    print(report(doc))
    for option, path, write in (("--json", args.json, doc.write), ("--plot", args.plot, lambda p: plot(doc, p))):
        if path:
            try:
                write(path)
            except OSError as exc:
                raise write_failed(path, option, exc) from None
    return 0 if any(s.rows for s in doc.sections.values()) else 1
