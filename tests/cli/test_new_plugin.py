"""``omni-plugins new-plugin``: the generated distribution installs and passes its own tests unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omni_plugins.errors import ConfigError
from omni_plugins.scaffold import generate, plugin_names
from omni_plugins.scaffold.verify import install_and_test


def test_generated_plugin_installs_and_passes_its_tests(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    proc = subprocess.run(
        [sys.executable, "-m", "omni_plugins", "new-plugin", "scratch-store", "--dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "pyproject.toml").read_text().count('scratch-store = "omni_plugins_scratch_store.plugin"') == 1
    result = install_and_test(out, tmp_path / "site", "-rs")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
    # both kits ran and every service the scaffold offers was exercised: only what it does not offer is skipped (a server, a floor, variants, wait_any)
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    expected = ("no 'start_server' service", "does not offer wait_any", "no 'floor_baseline' service", "no 'bench_variants' service")
    assert skipped and all(any(why in line for why in expected) for line in skipped), skipped
    assert (tmp_path / "site" / "omni_plugins_scratch_store" / "py.typed").is_file()  # installed with its type information


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    generate("abc", tmp_path)
    with pytest.raises(ConfigError, match="--force"):
        generate("abc", tmp_path)
    root, files = generate("abc", tmp_path, force=True)
    assert root == tmp_path and len(files) == 11


@pytest.mark.parametrize("bad", ["Bad", "1abc", "a_b", "a--b", "-a", ""])
def test_bad_names_rejected(bad: str) -> None:
    with pytest.raises(ConfigError, match="plugin name"):
        plugin_names(bad)


def test_names_derived() -> None:
    n = plugin_names("fs-dir")
    assert (n.dist, n.pkg, n.cls) == ("omni-plugins-fs-dir", "omni_plugins_fs_dir", "FsDir")


@pytest.mark.parametrize("taken", ["shm", "memory", "redis", "mooncake", "mooncake-store", "mooncake-te"])
def test_names_of_the_projects_own_connectors_are_refused(taken: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"plugin name '{taken}' is taken by this project's omni-plugins"):
        generate(taken, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_connector_class_carries_its_config_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Named by import path (no registry entry), the connector's settings come from its ``config_model``."""
    import uuid

    from omni_plugins.factory import validate_connector_config

    names = plugin_names(f"probe{uuid.uuid4().hex[:8]}")
    root, _ = generate(names.name, tmp_path / names.dist)
    monkeypatch.syspath_prepend(str(root))
    path = f"{names.pkg}.connector:{names.cls}Connector"
    settings = validate_connector_config(path, {"directory": str(tmp_path / "d")})
    assert type(settings).__name__ == f"{names.cls}Config" and settings.directory == str(tmp_path / "d")  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="directoy"):
        validate_connector_config(path, {"directoy": "x"})


def test_generated_connector_reports_leftovers_where_run_looks_for_leaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``omni-plugins run`` finds a plugin's leftovers only in its ``health()`` (``staged``): the scaffold must report them."""
    import uuid

    from omni_plugins import create_connector
    from omni_plugins.pipeline.leaks import health_leaks

    names = plugin_names(f"probe{uuid.uuid4().hex[:8]}")
    root, _ = generate(names.name, tmp_path / names.dist)
    monkeypatch.syspath_prepend(str(root))
    with create_connector(f"{names.pkg}.connector:{names.cls}Connector", {"directory": str(tmp_path / "d")}) as conn:
        assert health_leaks("stage 0", conn.health()) == []
        conn.put(0, 1, "never-read", {"v": 1})
        assert health_leaks("stage 0", conn.health()) == ["stage 0: connector still holds 1 staged payload(s)"]
        assert conn.cleanup("never-read")
