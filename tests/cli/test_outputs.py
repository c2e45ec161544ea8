"""Output paths (``run --report``, ``bench --json/--plot``, ``new-plugin --dir``) fail cleanly before the work starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_plugins.cli import main
from omni_plugins.cli.outputs import check_writable
from omni_plugins.errors import ConfigError


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("the work started although its output cannot be written")


def test_check_writable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--report .*missing/r\.json: cannot write: No such file or directory"):
        check_writable(str(tmp_path / "missing" / "r.json"), "--report")
    with pytest.raises(ConfigError, match="is a directory"):
        check_writable(str(tmp_path), "--report")
    existing = tmp_path / "old.json"
    existing.write_text("keep")
    check_writable(str(existing), "--report")
    assert existing.read_text() == "keep"
    check_writable(str(tmp_path / "new.json"), "--report")
    assert not (tmp_path / "new.json").exists()
    check_writable(None, "--report")


def test_run_report_in_a_missing_directory_fails_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import omni_plugins.pipeline

    monkeypatch.setattr(omni_plugins.pipeline, "run_pipeline", _never)
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text("stages: [{stage_id: 0}]\n")
    assert main(["run", str(pipeline), "--report", str(tmp_path / "nope" / "r.json"), "--no-progress"]) == 1
    assert "--report" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_output_in_a_missing_directory_fails_before_measuring(
    option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import omni_plugins.bench

    monkeypatch.setattr(omni_plugins.bench, "run_bench", _never)
    assert main(["bench", "--backends", "shm", option, str(tmp_path / "nope" / "out")]) == 1
    assert f"{option} " in capsys.readouterr().err


def test_new_plugin_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["new-plugin", "zz-top", "--dir", str(afile)]) == 1
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main(["new-plugin", "zz-top", "--dir", str(afile / "sub")]) == 1
    assert f"cannot write the plugin to {afile / 'sub'}" in capsys.readouterr().err
    assert afile.read_text() == "x"
