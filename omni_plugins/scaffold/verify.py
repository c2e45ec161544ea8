"""Install a plugin distribution into a private site directory and run its tests there (a real check, no mocks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def install_and_test(src: Path, site: Path, *pytest_args: str, timeout: float = 400.0) -> subprocess.CompletedProcess[str]:
    """``pip install --no-deps --no-build-isolation --target site src``, then ``pytest src/tests`` with ``PYTHONPATH=site``."""
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-compile",
        "--target",
        str(site),
        str(src),
    ]
    subprocess.run(pip, check=True, capture_output=True, text=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(src / "tests"), *pytest_args]
    return subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
