"""``omni-plugins run`` over fan-in, fan-out, replicated and hybrid graphs, with real processes and backends.

The example pipelines (shared memory) run in ``tests/examples``; here the same
graphs run over Redis and the hybrid one over the Mooncake store, then the
failure cases: a slow source, a dead source, a replica killed mid-run, and TP
on both sides of a streaming fan-in edge. Every run ends with the report's
leak checks plus a look at the backend itself.
"""

from __future__ import annotations

import os
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_plugins.config import load_pipeline_config
from omni_plugins.pipeline import RunOptions, build_plan, run_pipeline
from omni_plugins.pipeline.launcher import Orchestrator
from omni_plugins.pipeline.report import RunReport

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
OPTS = RunOptions(requests=3, concurrency=2, progress=False, timeout_s=240, stall_s=120)


def variant(tmp_path: Path, example: str, connectors: dict[str, Any], **stage_changes: dict[str, Any]) -> Path:
    """``examples/<example>`` with its connectors replaced (and stages changed: ``stage_<id>={field: value}``)."""
    data = yaml.safe_load((EXAMPLES / example).read_text())
    data["connectors"] = connectors
    for key, change in stage_changes.items():
        stage = next(s for s in data["stages"] if s["stage_id"] == int(key.removeprefix("stage_")))
        stage.update(change)
    path = tmp_path / f"{uuid.uuid4().hex[:6]}-{example}"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def assert_clean(report: RunReport) -> None:
    assert report.ok, report.table()
    assert report.leaks == [] and report.reclaimed == [] and report.deaths == []


def edge(report: RunReport, name: str) -> dict[str, Any]:
    found = [e for e in report.edges if e["edge"] == name]
    assert len(found) == 1, [e["edge"] for e in report.edges]
    return found[0]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[Any]:
    testing = pytest.importorskip("omni_plugins_redis.testing")
    with testing.RedisServer(password="topology-pw") as server:
        yield server


@pytest.fixture
def shm_ns() -> str:
    pytest.importorskip("omni_plugins_shm")
    return f"topo-{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize("example", ["pipeline-fanin.yaml", "pipeline-fanout.yaml", "pipeline-pd.yaml"])
def test_fan_in_fan_out_and_replicas_over_redis(tmp_path: Path, redis_server: Any, example: str) -> None:
    prefix = f"topo-{uuid.uuid4().hex[:6]}:"
    (name,) = yaml.safe_load((EXAMPLES / example).read_text())["connectors"]
    conn = {"name": "redis", "extra": redis_server.connector_config(key_prefix=prefix, ttl_seconds=120)}
    report = run_pipeline(variant(tmp_path, example, {name: conn}), OPTS)
    assert_clean(report)
    assert redis_server.keys(f"{prefix}*") == []
    if example == "pipeline-fanin.yaml":
        assert edge(report, f"0->2 {name} (full)")["payloads"] == edge(report, f"1->2 {name} (full)")["payloads"] == OPTS.requests
    elif example == "pipeline-fanout.yaml":
        assert edge(report, f"0->1 {name} (stream)")["payloads"] == edge(report, f"0->2 {name} (stream)")["payloads"] == OPTS.requests * 16
    else:
        assert sum(r["completed"] for r in report.replicas) == OPTS.requests
        assert sum(edge(report, f"0.r{r}->1 {name} (KV)")["payloads"] for r in (0, 1)) == OPTS.requests


def test_hybrid_over_the_mooncake_store_and_shm(tmp_path: Path, shm_ns: str) -> None:
    testing = pytest.importorskip("omni_plugins_mooncake.testing")
    from omni_plugins_shm.testing import assert_namespace_empty

    testing.loopback_environment()
    try:
        master = testing.MooncakeMaster().start()
    except RuntimeError as exc:
        pytest.skip(f"mooncake_master unavailable: {exc}")
    try:
        store = {
            "name": "mooncake-store",
            "extra": {"master_address": master.address, "global_segment_size": "64MiB", "local_buffer_size": "16MiB", "protocol": "tcp"},
        }
        local = {"name": "shm", "extra": {"namespace": shm_ns, "pool_bytes": 64 << 20}}
        report = run_pipeline(variant(tmp_path, "pipeline-hybrid.yaml", {"net": store, "local": local}), OPTS)
    finally:
        master.stop()
    assert_clean(report)
    assert edge(report, "0->1 net (stream)")["payloads"] == OPTS.requests * 16
    assert edge(report, "0->1 net (KV)")["payloads"] == OPTS.requests
    assert edge(report, "1->2 local (stream)")["payloads"] == OPTS.requests * 8
    assert_namespace_empty(shm_ns)


def _fanin(tmp_path: Path, shm_ns: str, **stage_changes: dict[str, Any]) -> Path:
    return variant(tmp_path, "pipeline-fanin.yaml", {"shm": {"name": "shm", "extra": {"namespace": shm_ns}}}, **stage_changes)


def test_fan_in_with_a_slow_source_fails_its_requests_naming_it_and_leaves_nothing(tmp_path: Path, shm_ns: str) -> None:
    from omni_plugins_shm.testing import namespace_segments

    path = _fanin(tmp_path, shm_ns, stage_1={"synthetic": {"steps": 2, "step_ms": 4000, "send": "full", "outputs": [
        {"name": "embed.image", "shape": [4, 64], "dtype": "bfloat16"}]}}, stage_2={"recv_timeout_s": 2.0})  # fmt: skip
    report = run_pipeline(path, RunOptions(requests=2, concurrency=2, progress=False, timeout_s=120))
    assert report.completed == 0 and len(report.failed) == 2
    for reason in report.failed.values():
        assert "stage 2 rank 0: timed out waiting for input from stage(s) [1]" in reason, reason
    # the text encoder's payloads arrived and went with the failed requests; the image encoder was aborted
    assert report.leaks == [] and report.deaths == [] and report.reclaimed == []
    assert namespace_segments(shm_ns) == []


def test_fan_in_with_a_dead_source_is_reported_and_what_the_other_sent_is_freed(tmp_path: Path, shm_ns: str) -> None:
    from omni_plugins_shm.testing import namespace_segments

    path = _fanin(tmp_path, shm_ns, stage_1={"synthetic": {"steps": 100000, "step_ms": 5, "send": "full", "outputs": [
        {"name": "embed.image", "shape": [4, 64], "dtype": "bfloat16"}]}})  # fmt: skip
    orch = Orchestrator(build_plan(load_pipeline_config(path), filename=str(path)), RunOptions(requests=2, concurrency=2, progress=False))
    ready = orch._wait_ready

    def ready_then_kill(bar: Any) -> bool:
        ok = ready(bar)
        os.kill(next(p for p in orch.procs if p.stage == 1).process.pid, 9)
        return ok

    orch._wait_ready = ready_then_kill  # type: ignore[method-assign]
    report = orch.run()
    assert any(d.startswith("stage 1 rank 0") and "SIGKILL" in d for d in report.deaths), report.deaths
    assert report.completed == 0 and report.lost
    # the denoiser held the text encoder's payloads: aborted when the run stopped, nothing stays in its runtime
    assert not any("runtime still holds" in leak for leak in report.leaks), report.leaks
    assert any("shm file(s)" in r for r in report.reclaimed), report.reclaimed  # the dead encoder's, freed by the run
    assert namespace_segments(shm_ns) == []


def test_a_replica_killed_mid_run_fails_only_its_own_requests(tmp_path: Path, shm_ns: str) -> None:
    from omni_plugins_shm.testing import namespace_segments

    path = variant(tmp_path, "pipeline-pd.yaml", {"shm": {"name": "shm", "extra": {"namespace": shm_ns, "pool_bytes": 64 << 20}}})
    orch = Orchestrator(build_plan(load_pipeline_config(path), filename=str(path)), RunOptions(requests=6, concurrency=2, progress=False))
    admit = orch._admit

    def admit_then_kill(rid: str) -> None:
        admit(rid)
        if orch.routes[rid][0] == 1 and not orch.dead:  # replica 1 holds a request: kill it now
            os.kill(next(p for p in orch.procs if p.key == (0, 1, 0)).process.pid, 9)

    orch._admit = admit_then_kill  # type: ignore[method-assign]
    report = orch.run()
    assert [d for d in report.deaths if "SIGKILL" in d and d.startswith("stage 0 replica 1 rank 0")], report.deaths
    lost_to_replica_1 = {rid for rid, route in orch.routes.items() if route[0] == 1}
    assert set(report.failed) == lost_to_replica_1 and lost_to_replica_1
    for reason in report.failed.values():
        assert "stage 0 replica 1 died: killed by signal SIGKILL" in reason, reason
    assert report.completed == 6 - len(lost_to_replica_1) and not report.lost
    assert {(r["replica"], r["alive"]) for r in report.replicas} == {(0, True), (1, False)}
    assert not any("runtime still holds" in leak or "KV manager" in leak for leak in report.leaks), report.leaks
    assert namespace_segments(shm_ns) == []  # what the dead replica held was reclaimed


def test_tp_on_both_sides_of_a_streaming_fan_in_edge(tmp_path: Path, shm_ns: str) -> None:
    """A TP sender (rank 0 moves payloads) and a TP fan-in receiver (its follower gets each source from the leader)."""
    path = tmp_path / "tp-fanin.yaml"
    path.write_text(textwrap.dedent(f"""
        connectors: {{shm: {{name: shm, extra: {{namespace: {shm_ns}}}}}}}
        stages:
          - stage_id: 0
            tp_size: 2
            output_connectors: {{to_stage_2: shm}}
            synthetic: {{steps: 6, send: stream, outputs: [{{name: embed.text, shape: [1, 256], dtype: bfloat16}}]}}
          - stage_id: 1
            output_connectors: {{to_stage_2: shm}}
            synthetic: {{steps: 3, send: stream, outputs: [{{name: embed.image, shape: [4, 128], dtype: float32}}]}}
          - stage_id: 2
            tp_size: 2
            async_chunk: true
            worker_type: ar
            input_connectors: {{from_stage_0: shm, from_stage_1: shm}}
            output_connectors: {{to_stage_3: shm}}
            synthetic: {{steps: 4, send: full, outputs: [{{name: latents.x, shape: [2, 64], dtype: float16}}]}}
          - {{stage_id: 3, final_output: true, input_connectors: {{from_stage_2: shm}}}}
    """))
    report = run_pipeline(path, OPTS)
    assert_clean(report)
    assert edge(report, "0->2 shm (stream)")["payloads"] == OPTS.requests * 6
    assert edge(report, "1->2 shm (stream)")["payloads"] == OPTS.requests * 3
    assert edge(report, "2->3 shm (full)")["payloads"] == OPTS.requests
    assert sorted((s["stage"], s["rank"]) for s in report.stages) == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (3, 0)]
