"""Plugin discovery through real entry points of really installed dummy distributions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .conftest import RunCli, statuses


def test_list_shows_every_dummy_distribution_with_status(run_cli: RunCli) -> None:
    st = statuses(run_cli("list", "--json"))
    assert st["dummy"]["status"] == "loaded"
    assert st["dummy"]["distribution"] == "omni-test-good"
    assert st["dummy"]["version"] == "1.2.3"
    assert st["dummy"]["connectors"] == ["dummy"] and st["dummy"]["aliases"] == ["DummyConnector"]
    assert st["broken"]["status"] == "failed"
    assert "exploded on import" in st["broken"]["error"]
    assert st["misspelled"]["status"] == "failed"
    assert "omni_register_connector" in st["misspelled"]["error"]
    assert st["omni_plugins.builtin"]["status"] == "loaded"


def test_broken_plugin_warns_once_and_does_not_break_others(run_cli: RunCli) -> None:
    proc = run_cli("list")
    assert proc.returncode == 0
    assert proc.stderr.count("'broken'") == 1, proc.stderr
    assert "dummy" in proc.stdout


def test_strict_mode_raises_on_broken_plugin(run_cli: RunCli) -> None:
    proc = run_cli("list", "--json", env={"OMNI_PLUGINS_STRICT": "1"})
    assert proc.returncode != 0
    assert "failed to load" in proc.stderr and "exploded on import" in proc.stderr


def test_allow_list_applies_before_import(run_cli: RunCli) -> None:
    st = statuses(run_cli("list", "--json", env={"OMNI_PLUGINS": "dummy"}))
    assert st["dummy"]["status"] == "loaded"
    # 'broken' raises at import: blocked (not failed) proves it was never imported
    assert st["broken"]["status"] == "blocked"
    assert st["duplicate"]["status"] == "blocked"


def test_allow_list_by_distribution_name(run_cli: RunCli) -> None:
    st = statuses(run_cli("list", "--json", env={"OMNI_PLUGINS": "omni-test-good"}))
    assert st["dummy"]["status"] == "loaded" and st["broken"]["status"] == "blocked"


def test_empty_allow_list_loads_no_plugins(run_cli: RunCli) -> None:
    st = statuses(run_cli("list", "--json", env={"OMNI_PLUGINS": ""}))
    assert {n: s["status"] for n, s in st.items() if n != "omni_plugins.builtin"} == {
        n: "blocked" for n in st if n != "omni_plugins.builtin"
    }
    assert st["omni_plugins.builtin"]["status"] == "loaded"


def test_deny_list_disables(run_cli: RunCli) -> None:
    st = statuses(run_cli("list", "--json", env={"OMNI_PLUGINS_DISABLE": "broken,misspelled"}))
    assert st["broken"]["status"] == "disabled" and st["misspelled"]["status"] == "disabled"
    assert st["dummy"]["status"] == "loaded"


def _py(dummy_site: Path, code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PLUGINS")}
    full["PYTHONPATH"] = str(dummy_site)
    full.update(env or {})
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_duplicate_name_is_an_error_naming_both(dummy_site: Path) -> None:
    proc = _py(
        dummy_site, "import omni_plugins as o\ntry:\n o.create_connector('DUMMY')\nexcept o.DuplicateConnectorError as e: print('DUP', e)"
    )
    assert "DUP" in proc.stdout, proc.stderr
    assert "omni-test-good" in proc.stdout and "omni-test-duplicate" in proc.stdout


def test_dist_prefix_picks_one_and_aliases_are_canonical(dummy_site: Path) -> None:
    code = (
        "import omni_plugins as o\n"
        "c = o.create_connector('omni-test-good:dummy', {'namespace': 'n1', 'label': 'x'})\n"
        "print(type(c).__name__, c.config.label)\n"
        "c2 = o.create_connector('omni_test_good:DUMMYconnector')\n"
        "print(type(c2).__name__)\n"
    )
    proc = _py(dummy_site, code)
    assert proc.stdout.split() == ["DummyConnector", "x", "DummyConnector"], proc.stderr


def test_failed_plugin_raises_with_its_cause_when_chosen(dummy_site: Path) -> None:
    code = (
        "import omni_plugins as o\n"
        "try:\n o.create_connector('broken')\n"
        "except o.ConnectorNotFoundError as e: print('ERR', e, '| CAUSE', type(e.__cause__).__name__, e.__cause__)\n"
    )
    proc = _py(dummy_site, code)
    assert "ERR" in proc.stdout and "failed to load" in proc.stdout, proc.stderr
    assert "CAUSE RuntimeError omni_test_broken exploded on import" in proc.stdout


def test_loading_is_idempotent(dummy_site: Path) -> None:
    code = (
        "from omni_plugins.plugins import get_plugin_manager\n"
        "m = get_plugin_manager()\n"
        "before = [s.to_json() for s in m.registry.specs()], len(m.statuses)\n"
        "m.load(); m.load(); get_plugin_manager().load()\n"
        "after = [s.to_json() for s in m.registry.specs()], len(m.statuses)\n"
        "print(before == after, len(before[0]))\n"
    )
    proc = _py(dummy_site, code, env={"OMNI_PLUGINS": "dummy,duplicate"})
    assert proc.stdout.split() == ["True", "3"], proc.stdout + proc.stderr


def test_import_path_loads_unregistered_connector(dummy_site: Path) -> None:
    proc = _py(
        dummy_site,
        "import omni_plugins as o\nc = o.create_connector('omni_plugins.memory:MemoryConnector', {'namespace': 'p'})\nprint(c.put(0, 1, 'k', {'a': 1}).ok)",
    )
    assert proc.stdout.strip() == "True", proc.stderr


def test_heavy_modules_not_imported_by_registration(dummy_site: Path) -> None:
    code = (
        "import sys, omni_plugins as o\no.available_connectors()\nprint('omni_test_good.connector' in sys.modules, 'torch' in sys.modules)"
    )
    proc = _py(dummy_site, code)
    assert proc.stdout.strip() == "False False", proc.stdout + proc.stderr
