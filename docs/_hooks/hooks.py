"""mkdocs hooks (``hooks:`` in mkdocs.yml): the parts of the docs that are made from the code.

A page asks for generated text with a line of its own::

    <!-- generated: connector-settings shm -->     the settings table of connector 'shm'
    <!-- generated: cli-help run -->               what 'omni-plugins run --help' prints
    <!-- generated: benchmark-results -->          tables of benchmarks/results/*.json
    <!-- generated: vllm-omni-names -->            the vLLM-Omni connector names the plugins declare

An unknown kind, or a generator that fails (e.g. a connector that is not installed), fails the
build. Each results file's plot is added to the site as ``benchmark-<file>.png``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchmark_results
import cli_help
import connector_settings
import vllm_omni_names

MARKER = re.compile(r"^<!-- generated: ([a-z-]+)((?: [^ >]+)*) -->$", re.MULTILINE)

#: read once per build, in on_files: the results documents and their plots' site paths
_bench: dict[str, Any] = {"results": [], "plots": {}}


def _benchmark_results() -> str:
    return benchmark_results.markdown(_bench["results"], plots=_bench["plots"])


GENERATORS: dict[str, Callable[..., str]] = {
    "connector-settings": connector_settings.settings_table,
    "cli-help": lambda *command: cli_help.help_block(" ".join(command)),
    "benchmark-results": _benchmark_results,
    "vllm-omni-names": vllm_omni_names.names_table,
}


def on_files(files: Files, config: Any) -> Files:
    try:
        _bench["results"] = benchmark_results.load()
    except ValueError as exc:
        raise PluginError(str(exc)) from exc
    _bench["plots"] = {}
    for name, doc in _bench["results"]:
        if not benchmark_results.plottable(doc):
            continue
        path = benchmark_results.plot_name(name)
        files.append(File.generated(config, path, content=benchmark_results.plot_png(doc)))
        _bench["plots"][name] = path
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    def fill(match: re.Match[str]) -> str:
        kind, args = match.group(1), match.group(2).split()
        generator = GENERATORS.get(kind)
        if generator is None:
            raise PluginError(f"{page.file.src_uri}: unknown generated block {kind!r} (known: {', '.join(sorted(GENERATORS))})")
        try:
            return generator(*args)
        except Exception as exc:
            raise PluginError(f"{page.file.src_uri}: generating {kind} {' '.join(args)} failed: {type(exc).__name__}: {exc}") from exc

    return MARKER.sub(fill, markdown)


_RST_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|exc|obj|const):(?=<code>)")


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """Docstrings use Sphinx roles (``:class:`X```); on the site the code span alone reads better."""
    return _RST_ROLE.sub("", html)
