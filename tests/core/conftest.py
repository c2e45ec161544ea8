from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

PLUGINS_DIR = Path(__file__).resolve().parents[1] / "plugins"


@pytest.fixture(scope="session")
def dummy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four dummy plugin distributions, really installed (pip) into a private site dir."""
    target = tmp_path_factory.mktemp("dummy-site")
    dists = [str(PLUGINS_DIR / d) for d in ("good", "broken", "duplicate", "misspelled")]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-compile",
            "--target",
            str(target),
            *dists,
        ],
        check=True,
        capture_output=True,
    )
    return target


RunCli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_cli(dummy_site: Path) -> RunCli:
    """Run ``python -m omni_plugins ARGS`` in a fresh process that sees the dummy plugins."""

    def run(*args: str, env: dict[str, str] | None = None, with_dummies: bool = True) -> subprocess.CompletedProcess[str]:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PLUGINS")}
        if with_dummies:
            full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(dummy_site), full_env.get("PYTHONPATH", "")) if p)
        full_env.update(env or {})
        return subprocess.run([sys.executable, "-m", "omni_plugins", *args], capture_output=True, text=True, env=full_env, timeout=120)

    return run


def statuses(proc: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    assert proc.returncode == 0, proc.stderr
    return {s["name"]: s for s in json.loads(proc.stdout)}
