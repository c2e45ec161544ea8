"""``omni-plugins bench``: the one benchmark engine; every result in one JSON format (:mod:`.schema`).

``runner`` (sections, backends, report), ``sizes`` (the size curve against raw baselines, over
``lanes``), ``load`` (the runtime under rising load), ``scaling`` (cost per chunk and memory per
request as streams grow), ``topology`` (fan-out and fan-in against a chain), ``peer`` (vLLM-Omni
in the same run), ``traffic`` (streams between stage processes), ``targets`` (bounds checked in
every run), ``plot``.
"""

from omni_plugins.bench.runner import SECTIONS, BenchOptions, backends, local_backends, report, run_bench
from omni_plugins.bench.schema import SCHEMA, BenchDocument, load_document
from omni_plugins.bench.targets import SizeTarget
from omni_plugins.bench.units import format_size, parse_size, parse_sizes

__all__ = [
    "SCHEMA",
    "SECTIONS",
    "BenchDocument",
    "BenchOptions",
    "SizeTarget",
    "backends",
    "format_size",
    "load_document",
    "local_backends",
    "parse_size",
    "parse_sizes",
    "report",
    "run_bench",
]
