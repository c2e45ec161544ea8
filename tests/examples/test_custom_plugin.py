"""``examples/custom-plugin`` is exactly what ``omni-plugins new-plugin fs-dir`` writes.

So the test that installs a freshly generated plugin and runs its conformance tests
(``tests/cli/test_new_plugin.py``) covers the example too, without a second install.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

from omni_plugins.scaffold import generate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom-plugin"


def test_example_is_what_new_plugin_writes(tmp_path: Path) -> None:
    root, files = generate("fs-dir", tmp_path / "fresh")
    for f in files:
        rel = f.relative_to(root)
        assert filecmp.cmp(f, EXAMPLE / rel, shallow=False), f"examples/custom-plugin/{rel} differs from the generator's output"
