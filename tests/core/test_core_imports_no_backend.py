"""The core knows no backend by name: nothing under omni_plugins/ imports a backend plugin or a backend's client library.

Built-in backends reach the core only through the plugin hooks and services, as any third-party
plugin does. Checked in the source (every import statement, lazy ones inside functions too, and
every import string such as a preload list or ``importlib.import_module("...")``) and at run time.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BANNED = ("omni_plugins_shm", "omni_plugins_redis", "omni_plugins_mooncake", "redis", "mooncake")
#: an import string naming a banned module: "redis", "redis.cluster", "omni_plugins_shm.connector:ShmConnector"
IMPORT_STRING = re.compile(r"^(omni_plugins_(shm|redis|mooncake)([.:].*)?|(redis|mooncake)[.:].*)$")


def _banned(module: str) -> bool:
    return module.split(".")[0] in BANNED


def _violations(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _banned(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _banned(node.module):
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings and IMPORT_STRING.match(node.value):
            found.append(f"import string {node.value!r}")
    return [f"{path.relative_to(root)}:{v}" for v in found]


def test_no_module_of_the_core_names_a_backend() -> None:
    violations = [v for path in sorted((ROOT / "omni_plugins").rglob("*.py")) for v in _violations(path)]
    assert violations == []


def test_the_check_catches_each_way_of_importing(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""Mentions omni_plugins_shm.gc in a docstring: fine."""\n'
        "import redis.cluster\n"
        "def f():\n"
        "    from omni_plugins_mooncake.testing import MooncakeMaster\n"
        "    import importlib\n"
        "    return importlib.import_module('omni_plugins_shm.connector'), ['mooncake.store']\n"
        "KNOWN = {'redis': 'omni-plugins-redis'}  # a connector name and a distribution: fine\n"
    )
    assert [v.split(":", 1)[1] for v in _violations(probe, tmp_path)] == [
        "import redis.cluster",
        "from omni_plugins_mooncake.testing import ...",
        "import string 'omni_plugins_shm.connector'",
        "import string 'mooncake.store'",
    ]


def _violations_at(path: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        return _violations(path)
    finally:
        ROOT = saved


def test_using_the_core_imports_no_backend() -> None:
    """Every core module imported and the CLI parser built (no plugin loaded): no backend module in sys.modules."""
    code = (
        "import importlib, pkgutil, sys, omni_plugins\n"
        "skip = {'omni_plugins.__main__', 'omni_plugins.testing.pytest_plugin'}\n"
        "for m in pkgutil.walk_packages(omni_plugins.__path__, 'omni_plugins.'):\n"
        "    if m.name not in skip: importlib.import_module(m.name)\n"
        "from omni_plugins.cli import build_parser\n"
        "build_parser()\n"
        f"print(sorted(n for n in sys.modules if n.split('.')[0] in {BANNED!r}))\n"
    )
    env = {**os.environ, "OMNI_PLUGINS": ""}  # no entry-point plugin: only what the core itself imports
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
