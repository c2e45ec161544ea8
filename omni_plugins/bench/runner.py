"""``omni-plugins bench``: the sections of a run, one document, one report.

Sections: ``sizes`` (every backend against its raw baseline at every size, :mod:`.sizes`),
``load`` (the runtime under rising load against the connector alone, :mod:`.load`),
``scaling`` (the runtime's cost per chunk and memory per request as streams grow,
:mod:`.scaling`), ``topology`` (fan-out and fan-in against a chain, :mod:`.topology`) and
``peer`` (vLLM-Omni's own connector and runtime in the same run, :mod:`.peer`). A backend is any registered connector whose plugin offers a raw baseline
(services ``bench_config`` and ``raw_baseline``); its private server, if its plugin has one, is
started for the run (loopback, a free port) unless the user gave the backend's config. A
backend whose plugin, binary or server is missing is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_plugins.bench.schema import BenchDocument, Column, Machine, Section
from omni_plugins.bench.units import KIB, MIB

if TYPE_CHECKING:
    from tqdm import tqdm

    from omni_plugins.services import ConnectorServices

logger = logging.getLogger(__name__)

#: the size curve every backend is measured at unless ``--sizes`` says otherwise
DEFAULT_SIZES = [4 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
#: sizes of a ``--quick`` run
QUICK_SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB]
SECTIONS = ("sizes", "load", "scaling", "topology", "peer")


def backends() -> list[str]:
    """Registered connectors whose plugins offer a raw baseline, by name (imports each plugin's services)."""
    from omni_plugins.services import offered, registered_services

    return sorted(name for name, services in registered_services().items() if "raw_baseline" in offered(services))


def local_backends() -> list[str]:
    """Bench backends that move payloads between processes of one host and need no server: the runtime's defaults."""
    from omni_plugins.factory import resolve_connector
    from omni_plugins.importing import import_string
    from omni_plugins.services import offered, services_for

    out = []
    for name in backends():
        services = services_for(name)
        if services is None or "start_server" in offered(services):
            continue
        try:
            caps = import_string(resolve_connector(name).connector).capabilities
        except Exception:
            continue
        if caps.cross_process and not caps.cross_host and caps.blocking_get:
            out.append(name)
    return out


class Skip(Exception):
    """This backend cannot run here; the message says why."""


@dataclass
class BenchOptions:
    sections: list[str] = field(default_factory=lambda: ["sizes"])
    backends: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    quick: bool = False
    #: per backend, a config of the user's (a stage's ``extra``) laid over the plugin's bench config; no server is started for it
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per backend, the size curve's further connector lanes: variant name -> config overlay (``--variant``, an A/B in one run)
    variants: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    progress: bool = True
    #: the backend the load, scaling and peer sections run the runtime over (None: the first local backend)
    runtime_backend: str | None = None
    #: the traffic of the load, scaling and peer sections (:class:`omni_plugins.bench.load.LoadOptions`)
    load: Any = None


def machine() -> Machine:
    import psutil
    import torch

    return Machine(
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        cpus=os.cpu_count(),
        memory_gib=round(psutil.virtual_memory().total / (1 << 30), 1),
        load_avg_start=[round(x, 2) for x in os.getloadavg()],
    )


@dataclass
class Prepared:
    """A backend ready to measure: its bench config (the user's laid over the plugin's) and its services."""

    name: str
    config: dict[str, Any]
    services: ConnectorServices[Any]


@contextlib.contextmanager
def prepared_backend(name: str, configs: dict[str, dict[str, Any]], max_bytes: int) -> Iterator[Prepared]:
    """``name``'s bench config with its private server running (unless the user gave a config) and a scratch directory.

    After the block the backend's census (if offered) must find nothing of the benchmark left.
    """
    from omni_plugins.errors import OmniPluginsError
    from omni_plugins.services import RunScope, ServiceUnavailable, offered, require

    try:
        services = require(name, "raw_baseline")
    except OmniPluginsError as exc:
        raise Skip(str(exc)) from None
    user = configs.get(name)
    scratch = Path(tempfile.mkdtemp(prefix="omni-bench-"))
    server = None
    try:
        if user is None and "start_server" in offered(services):
            try:
                server = services.start_server()
            except ServiceUnavailable as exc:
                raise Skip(f"{exc} (or give the backend's config: --config {name}=JSON)") from None
        config = {**services.bench_config(max_bytes, server, scratch), **(user or {})}
        yield Prepared(name, config, services)
        if "census" in offered(services):
            from omni_plugins.factory import validate_connector_config

            left = services.census(validate_connector_config(name, config), RunScope(uuid.uuid4().hex[:8]))
            if left.count:
                logger.warning("bench of %s left %s", name, left.census_line())
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


# -- the size curve ------------------------------------------------------------------------------
SIZE_COLUMNS = [
    Column(key="backend", label="backend", kind="text"),
    Column(key="variant", label="variant", kind="text"),
    Column(key="size", label="size", kind="size"),
    Column(key="raw_gbps", label="raw GB/s", digits=3),
    Column(key="connector_gbps", label="connector GB/s", digits=3),
    Column(key="ratio", label="ratio"),
    Column(key="put_ratio", label="put ratio"),
    Column(key="get_ratio", label="get ratio"),
    Column(key="floor_ratio", label="floor ratio"),
    Column(key="raw_transfer_us", label="raw put+get us", digits=1),
    Column(key="connector_transfer_us", label="connector put+get us", digits=1),
    Column(key="round_trip_vs_pipe", label="round trip / pipe"),
]

SIZES_ABOUT = (
    "Producer and consumer in separate processes, each with its own connections. Per size, the raw "
    "baseline (the same bytes through the backend without the connector), the floor where the plugin "
    "offers one, the connector and its variants are interleaved in rounds. put and get are timed in "
    "their own processes on one system-wide clock; ratio = raw (put + get) / connector (put + get), "
    "put ratio and get ratio likewise per side (above 1: faster than raw); the harness's notice and "
    "reply hops are in neither. floor ratio = raw / floor: the best a connector doing only what it "
    "cannot avoid could reach. round trip / pipe: the payload there and back through the connector, "
    "each side blocked in get, over the same bytes there and back on a pipe."
)


def lanes_of(prepared: Prepared, max_bytes: int, variants: dict[str, dict[str, Any]] | None = None) -> list[Any]:
    """The size curve's lanes: the raw baseline, the floor (if offered), the connector, the plugin's variants and ``variants``."""
    from omni_plugins.bench.lanes import LaneSpec
    from omni_plugins.services import offered

    name, config = prepared.name, prepared.config
    lanes = [LaneSpec("raw", "raw", name, config, max_bytes)]
    if "floor_baseline" in offered(prepared.services):
        lanes.append(LaneSpec("floor", "floor", name, config, max_bytes))
    lanes.append(LaneSpec("connector", "connector", name, config, max_bytes))
    for variant, overlay in {**prepared.services.bench_variants, **(variants or {})}.items():
        lanes.append(LaneSpec(f"connector:{variant}", "connector", name, {**config, **overlay}, max_bytes))
    return lanes


def run_sizes(opts: BenchOptions, doc: BenchDocument, bar: tqdm) -> None:
    from omni_plugins.bench import sizes
    from omni_plugins.bench.targets import check_size_target
    from omni_plugins.services import offered, services_for

    section = doc.sections.setdefault("sizes", Section(title="Size curve", about=SIZES_ABOUT, columns=SIZE_COLUMNS))
    max_bytes = max(opts.sizes)
    for name in opts.backends:
        bar.set_postfix_str(f"sizes: {name}")
        started = time.monotonic()
        try:
            with prepared_backend(name, opts.configs, max_bytes) as prepared:
                lanes = lanes_of(prepared, max_bytes, opts.variants.get(name))
                connectors = sum(lane.kind == "connector" for lane in lanes)
                bar.total += sizes.planned_ops(len(lanes), connectors + 1, opts.sizes, opts.quick)
                section.rows += sizes.measure(name, lanes, opts.sizes, opts.quick, tick=bar.update)
        except Skip as exc:
            doc.skipped[f"sizes: {name}"] = str(exc)
            continue
        except Exception as exc:
            logger.debug("bench of %s failed", name, exc_info=True)
            doc.skipped[f"sizes: {name}"] = f"failed: {type(exc).__name__}: {exc}"
            continue
        finally:
            logger.info("sizes of %s took %.1fs", name, time.monotonic() - started)
        services = services_for(name)
        floor_about = "the plugin's floor baseline (floor_baseline service)" if services and "floor_baseline" in offered(services) else ""
        for target in services.bench_targets if services is not None else ():
            doc.targets.append(check_size_target(target, name, section.rows, floor_about))


# -- the run -------------------------------------------------------------------------------------
def _section_runner(name: str) -> Callable[[BenchOptions, BenchDocument, Any], None]:
    if name == "sizes":
        return run_sizes
    if name == "load":
        from omni_plugins.bench.load import run_load

        return run_load
    if name == "scaling":
        from omni_plugins.bench.scaling import run_scaling

        return run_scaling
    if name == "topology":
        from omni_plugins.bench.topology import run_topology

        return run_topology
    if name == "peer":
        from omni_plugins.bench.peer import run_peer

        return run_peer
    raise ValueError(f"unknown section {name!r}; one of {', '.join(SECTIONS)}")


def script_document(quick: bool) -> BenchDocument:
    """The document of a benchmark script of ``benchmarks/``: its command line, this machine; final unless ``quick``."""
    import shlex
    import sys

    argv = [os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "?", *sys.argv[1:]]
    return BenchDocument(command="python " + " ".join(shlex.quote(a) for a in argv), final=not quick, machine=machine())


def run_bench(opts: BenchOptions, command: str = "") -> BenchDocument:
    """Run every section of ``opts`` into one document."""
    from tqdm import tqdm

    doc = BenchDocument(command=command, final=not opts.quick, machine=machine())
    with tqdm(total=0, desc="bench", unit="op", disable=not opts.progress, leave=False, dynamic_ncols=True) as bar:
        for name in opts.sections:
            _section_runner(name)(opts, doc, bar)
    doc.machine.load_avg_end = [round(x, 2) for x in os.getloadavg()]
    return doc


def report(doc: BenchDocument) -> str:
    """The document as plain-text tables: every section, then every target."""
    lines: list[str] = []
    for name, section in doc.sections.items():
        lines += [f"== {section.title} ({name})", *_aligned(doc.table(name)), ""]
    if doc.targets:
        cells = [["target", "subject", "measured", "bound", "at", "met", "floor"]]
        for t in doc.targets:
            measured = "-" if t.measured is None else f"{t.measured:.3g}"
            met = "-" if t.met is None else ("yes" if t.met else "NO")
            floor = "-" if t.floor is None else f"{t.floor:.3g}" + (" (out of reach)" if t.reachable is False and not t.met else "")
            cells.append([t.description, t.subject, measured, f"{t.op} {t.bound:g}", t.at or "-", met, floor])
        lines += ["== Targets", *_aligned(cells), ""]
    lines += [f"skipped {what}: {why}" for what, why in doc.skipped.items()]
    if not doc.final:
        lines.append("(a --quick run: a check of the harness, not figures to quote)")
    return "\n".join(lines)


def _aligned(cells: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in cells]
