"""The one results format: written, read back, refused when it is something else, rendered by the docs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from omni_plugins.bench.schema import BenchDocument, Column, Section, TargetResult, load_document

ROOT = Path(__file__).resolve().parents[2]


def _doc() -> BenchDocument:
    doc = BenchDocument(command="omni-plugins bench --quick", final=False)
    doc.sections["sizes"] = Section(
        title="Size curve",
        about="what it measures",
        columns=[
            Column(key="backend", label="backend", kind="text"),
            Column(key="size", label="size", kind="size"),
            Column(key="ratio", label="ratio"),
        ],
        rows=[{"backend": "shm", "size": 65536, "ratio": 0.912}, {"backend": "shm", "size": 1 << 20, "ratio": None}],
    )
    doc.targets.append(
        TargetResult(
            section="sizes",
            subject="shm",
            description="ratio >= 0.9",
            op=">=",
            bound=0.9,
            measured=0.912,
            at="64KiB",
            met=True,
            floor=1.1,
            reachable=True,
        )
    )
    return doc


def test_a_document_reads_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    _doc().write(path)
    data = json.loads(path.read_text())
    assert data["schema"] == "omni-plugins-bench/1" and data["final"] is False
    again = load_document(path)
    assert again == _doc()


def test_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    data = _doc().to_json()
    path.write_text(json.dumps({**data, "schema": "something-else/2"}))
    with pytest.raises(ValidationError):
        load_document(path)
    path.write_text(json.dumps({"results": {"shm": []}}))
    with pytest.raises(ValidationError):
        load_document(path)


def test_tables_show_sizes_numbers_and_gaps() -> None:
    assert _doc().table("sizes") == [["backend", "size", "ratio"], ["shm", "64KiB", "0.91"], ["shm", "1MiB", "-"]]


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> object:
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "_hooks"))
    import benchmark_results

    monkeypatch.setattr(benchmark_results, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(benchmark_results, "ROOT", tmp_path)
    yield benchmark_results
    sys.modules.pop("benchmark_results", None)


def test_the_performance_page_shows_every_section_and_target(hooks: object, tmp_path: Path) -> None:
    _doc().write(tmp_path / "bench.json")
    results = hooks.load()  # type: ignore[attr-defined]
    text = hooks.markdown(results, {"bench.json": "benchmark-bench.png"})  # type: ignore[attr-defined]
    assert "omni-plugins bench --quick" in text and "A short run" in text
    assert "#### Size curve" in text and "| shm | 64KiB | 0.91 |" in text
    assert "| ratio >= 0.9 | shm | 0.912 | >= 0.9 | 64KiB | **met** | 1.1 |" in text
    assert "![bench.json](benchmark-bench.png)" in text


def test_a_results_file_in_another_format_fails_the_docs_build(hooks: object, tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text(json.dumps({"results": {"shm": []}}))
    with pytest.raises(ValueError, match=r"old\.json is not an omni-plugins bench document"):
        hooks.load()  # type: ignore[attr-defined]
