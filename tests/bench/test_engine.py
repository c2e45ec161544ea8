"""``omni-plugins bench`` end to end, bounded: every section but the peer on the shared-memory backend.

Small sizes, a few streams, one round: it checks that every section measures, that the document
has every row and every target with a measured value, that nothing is left behind and that the
extras a run needs are checked before anything is measured. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from omni_plugins.bench.schema import load_document
from omni_plugins.cli import main

pytest.importorskip("omni_plugins_shm")


def _shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("omnishm.bench-")}


def test_every_section_measures_and_checks_its_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _shm_files()
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--sections", "all", "--backends", "shm", "--sizes", "4KiB,64KiB", "--quick", "--streams", "4", "--chunk", "4KiB"]
    argv += [
        "--intervals-ms",
        "8",
        "--scaling-streams",
        "2,4",
        "--tuning",
        'quiet={"anticipate_s": 0}',
        "--variant",
        f'shm:nolarger={{"namespace": "bench-{uuid.uuid4().hex[:8]}", "slot_classes": []}}',
        "--json",
        str(out),
        "--plot",
        str(png),
        "--no-progress",
    ]
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    doc = load_document(out)
    assert doc.final is False and doc.skipped == {} and doc.command.startswith("omni-plugins bench")
    assert set(doc.sections) == {"sizes", "load", "scaling", "topology"}

    sizes = {(r["variant"], r["size"]): r for r in doc.sections["sizes"].rows}
    assert set(sizes) == {(v, n) for v in ("", "views", "nolarger") for n in (4096, 65536)}
    for row in sizes.values():
        assert row["raw_transfer_us"] > 0 and row["connector_transfer_us"] > 0 and row["ratio"] > 0  # type: ignore[operator]
    assert sizes[("", 4096)]["round_trip_vs_pipe"] is not None

    load = doc.sections["load"].rows
    assert {r["mode"] for r in load} == {"runtime", "runtime:quiet", "floor", "connector"}
    assert all(r["missing"] == 0 for r in load)
    assert all(isinstance(r["delivered_vs_floor"], float) for r in load if r["mode"].startswith("runtime"))
    assert {r["streams"] for r in doc.sections["scaling"].rows} == {2, 4}
    assert all(r["bytes_per_request"] > 0 for r in doc.sections["scaling"].rows)  # type: ignore[operator]
    topology = {r["mode"]: r for r in doc.sections["topology"].rows}
    assert set(topology) == {"chain", "fanout", "fanin", "raw_chain", "raw_fanout", "raw_fanin"}
    assert all(r["missing"] == 0 for r in topology.values())
    assert topology["fanout"]["put_many"] and topology["raw_fanout"]["put_many"]  # a fan-out's chunk: one call for both edges
    assert topology["chain"]["put_many"] == topology["fanin"]["put_many"] == 0

    by_section: dict[str, list[Any]] = {}
    for t in doc.targets:
        by_section.setdefault(t.section, []).append(t)
    assert len(by_section["sizes"]) == 3 and len(by_section["load"]) == 2 and by_section["scaling"] and len(by_section["topology"]) == 1
    measured = [t for t in by_section["sizes"] if t.description.startswith(("4 KiB round trip", ">= 0.9x"))]
    assert all(t.measured is not None and t.met is not None for t in measured)
    assert png.stat().st_size > 1000
    assert _shm_files() <= before, "the benchmark left shared-memory files behind"
    assert "Targets" in capsys.readouterr().out


def test_a_missing_plot_extra_is_named_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import omni_plugins.bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(omni_plugins.bench, "run_bench", _never)
    assert main(["bench", "--backends", "shm", "--plot", str(tmp_path / "p.png"), "--no-progress"]) == 1
    assert "pip install 'omni-plugins[plot]'" in capsys.readouterr().err


def test_the_peer_section_outside_its_venv_says_how_to_run_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import omni_plugins.bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm_omni" else real(name, *a))
    monkeypatch.setattr(omni_plugins.bench, "run_bench", _never)
    assert main(["bench", "--sections", "peer", "--no-progress"]) == 1
    assert "bash scripts/setup.sh vllm-omni" in capsys.readouterr().err


def test_a_variant_needs_its_backend_in_the_size_curve(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import omni_plugins.bench

    monkeypatch.setattr(omni_plugins.bench, "run_bench", _never)
    assert main(["bench", "--backends", "shm", "--variant", "shm:x", "--no-progress"]) == 1
    assert "BACKEND:NAME=JSON-OBJECT" in capsys.readouterr().err
    assert main(["bench", "--sections", "load", "--variant", "shm:x={}", "--no-progress"]) == 1
    assert "whose size curve this run does not measure" in capsys.readouterr().err


def _never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the benchmark ran although an extra it needs is missing")


def test_a_failed_round_trip_reports_the_consumers_error() -> None:
    """The producer's side of a round trip fails by waiting for a reply that never comes; the consumer's own error says why."""
    import multiprocessing as mp

    from omni_plugins.bench.sizes import consumer_error

    ours, theirs = mp.Pipe()
    assert consumer_error(ours) is None  # nothing sent
    theirs.send(("error", "ConnectorError: read of key 'rt-0' failed"))
    assert consumer_error(ours) == "ConnectorError: read of key 'rt-0' failed"
    theirs.send(("ok", (1.0, 2.0)))
    assert consumer_error(ours) is None  # an answer, not an error
    theirs.close()
    assert consumer_error(ours) is None  # the consumer is gone without a word
