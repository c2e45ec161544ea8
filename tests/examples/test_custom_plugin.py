"""``examples/custom-plugin``: the out-of-tree connector installs and passes its conformance tests."""

from __future__ import annotations

import filecmp
from pathlib import Path

from omni_plugins.scaffold import generate
from omni_plugins.scaffold.verify import install_and_test

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom-plugin"


def test_example_is_what_new_plugin_writes(tmp_path: Path) -> None:
    root, files = generate("fs-dir", tmp_path / "fresh")
    for f in files:
        rel = f.relative_to(root)
        assert filecmp.cmp(f, EXAMPLE / rel, shallow=False), f"examples/custom-plugin/{rel} differs from the generator's output"


def test_custom_plugin_passes_its_tests(tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    result = install_and_test(src, tmp_path / "site")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
