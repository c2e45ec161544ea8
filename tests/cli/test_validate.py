"""``omni-plugins validate`` on files with ``synthetic:`` stages rejects everything ``run`` rejects."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from omni_plugins.cli import main

from .conftest import tiny_pipeline

TWO_STAGES = """
connectors:
  c: {{name: {name}, extra: {extra}}}
stages:
  - stage_id: 0
    async_chunk: true
    output_connectors: {{to_stage_1: c}}
    synthetic: {synthetic}
  - stage_id: 1
    async_chunk: {receiver_stream}
    input_connectors: {{from_stage_0: c}}
"""

TP_KV = """
connectors:
  c: {name: shm}
stages:
  - stage_id: 0
    tp_size: 2
    kv_transfer: true
    rank_mapping: {from_tp: 4, to_tp: 1}
    output_connectors: {to_stage_1: c}
    synthetic:
      send: full
      outputs: [{name: a.b, shape: [1, 2]}]
      kv: {heads: 8}
  - stage_id: 1
    kv_transfer: true
    rank_mapping: {from_tp: 2, to_tp: 1}
    input_connectors: {from_stage_0: c}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def _validate(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["validate", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _two_stages(tmp_path: Path, synthetic: str, *, name: str = "shm", extra: str = "{}", receiver_stream: str = "true") -> Path:
    pytest.importorskip("omni_plugins_shm")
    return _write(tmp_path, TWO_STAGES.format(name=name, extra=extra, synthetic=synthetic, receiver_stream=receiver_stream))


def test_every_synthetic_error_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _two_stages(tmp_path, "{steps: 0, send: strem, outputs: [{name: hidden, shape: [1], dtype: float8}], bogus: 1}")
    rc, out, err = _validate(path, capsys)
    assert rc == 1 and "ok" not in out
    where = f"{path}: stages[0] (stage 0).synthetic"
    for field in ("steps", "send", "outputs.0.dtype", "outputs.0.name", "outputs.0.shape", "bogus: unknown field 'bogus'"):
        assert f"{where}.{field}" in err, err


def test_stream_into_a_receiver_without_async_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _two_stages(tmp_path, "{outputs: [{name: a.b, shape: [1, 2]}]}", receiver_stream="false")
    rc, _, err = _validate(path, capsys)
    assert rc == 1
    assert "synthetic.send: 'stream' needs the receiving stage 1 to have async_chunk: true" in err


def test_rank_mapping_inconsistent_with_tp_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("omni_plugins_shm")
    rc, _, err = _validate(_write(tmp_path, TP_KV), capsys)
    assert rc == 1
    assert "stages[0] (stage 0).rank_mapping: the KV edge 0 -> 1 needs rank_mapping {from_tp: 2, to_tp: 1}" in err


def test_in_process_connector_is_rejected_with_the_other_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _two_stages(tmp_path, "{steps: 2}", name="memory")
    rc, _, err = _validate(path, capsys)
    assert rc == 1
    assert "connectors.c: connector 'memory' is in-process only" in err
    assert "emits no outputs" in err  # the plan's error too, not only the first one found


def test_memory_without_synthetic_stages_is_still_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = """
    connectors: {c: {name: memory}}
    stages:
      - {stage_id: 0, output_connectors: {to_stage_1: c}}
      - {stage_id: 1, input_connectors: {from_stage_0: c}}
    """
    rc, out, _ = _validate(_write(tmp_path, text), capsys)
    assert rc == 0 and "ok (2 stages" in out


def test_a_runnable_file_is_ok(tmp_path: Path, shm_ns: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _validate(tiny_pipeline(tmp_path, extra=f"{{namespace: {shm_ns}}}"), capsys)
    assert rc == 0, err
    assert "ok (2 stages, 1 edges, connectors: c)" in out


def test_every_example_pipeline_validates(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples, topologies included (a connector per edge, fan-in, fan-out, replicas), pass validate with every check on."""
    pytest.importorskip("omni_plugins_shm")
    pytest.importorskip("omni_plugins_redis")
    pytest.importorskip("omni_plugins_mooncake")
    monkeypatch.setenv("OMNI_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing is contacted
    files = sorted((Path(__file__).resolve().parents[2] / "examples").glob("pipeline-*.yaml"))
    assert {"pipeline-hybrid.yaml", "pipeline-fanin.yaml", "pipeline-fanout.yaml", "pipeline-pd.yaml"} <= {f.name for f in files}
    assert main(["validate", *map(str, files)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "pipeline-fanin.yaml: ok (4 stages, 3 edges" in out and "pipeline-hybrid.yaml: ok (3 stages, 2 edges, connectors: local, net)" in out


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("{outputs: [{name: a.b, shape: [1, 2], to: [5]}]}", "synthetic.outputs.0.to: stage 0 has no output edge to stage 5"),
        ("{outputs: [{name: a.b, shape: [1, 2], to: [1]}]}", "synthetic.outputs: no output goes to stage 2"),
    ],
)
def test_fan_out_outputs_to_names_real_edges_and_feeds_every_one(
    tmp_path: Path, change: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = f"""
    connectors: {{c: {{name: shm}}}}
    stages:
      - {{stage_id: 0, async_chunk: true, output_connectors: {{to_stage_1: c, to_stage_2: c}}, synthetic: {change}}}
      - {{stage_id: 1, async_chunk: true, input_connectors: {{from_stage_0: c}}}}
      - {{stage_id: 2, async_chunk: true, input_connectors: {{from_stage_0: c}}}}
    """
    rc, _, err = _validate(_write(tmp_path, text), capsys)
    assert rc == 1 and expected in err, err


def test_a_graph_in_two_pieces_is_not_one_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = """
    connectors: {c: {name: shm}}
    stages:
      - {stage_id: 0, async_chunk: true, output_connectors: {to_stage_1: c}, synthetic: {outputs: [{name: a.b, shape: [1, 2]}]}}
      - {stage_id: 1, async_chunk: true, input_connectors: {from_stage_0: c}}
      - {stage_id: 2, async_chunk: true, output_connectors: {to_stage_3: c}, synthetic: {outputs: [{name: a.b, shape: [1, 2]}]}}
      - {stage_id: 3, async_chunk: true, input_connectors: {from_stage_2: c}}
    """
    rc, _, err = _validate(_write(tmp_path, text), capsys)
    assert rc == 1 and "share no edge: [0, 1], [2, 3]" in err, err
