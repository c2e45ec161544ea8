"""Every example pipeline, run for real with a few requests: intact payloads, nothing leaked.

Each test runs ``omni-plugins run`` in a subprocess (stage processes are
spawned from it, as a user would see) and reads the JSON report. Servers are
started by the test (redis-server, mooncake_master) on free loopback ports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
REQUESTS = 2


def run_example(name: str, tmp_path: Path, env: dict[str, str] | None = None, *extra: str) -> dict[str, Any]:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "omni_plugins", "run", str(EXAMPLES / name), "--requests", str(REQUESTS)]
    cmd += ["--concurrency", "2", "--no-progress", "--timeout", "240", "--report", str(report), *extra]
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert "OK: " in proc.stdout
    data: dict[str, Any] = json.loads(report.read_text())
    assert data["ok"] and data["completed"] == REQUESTS and data["mismatches"] == 0
    assert data["leaks"] == [] and data["deaths"] == [] and data["lost"] == []
    return data


def edge(data: dict[str, Any], prefix: str, kind: str) -> dict[str, Any]:
    found = [e for e in data["edges"] if e["edge"].startswith(prefix) and e["edge"].endswith(f"({kind})")]
    assert len(found) == 1, f"no single {prefix} ({kind}) edge in {[e['edge'] for e in data['edges']]}"
    return found[0]


def check_speech_edges(data: dict[str, Any], thinker_steps: int, talker_steps: int) -> None:
    assert edge(data, "0->1", "stream")["payloads"] == REQUESTS * thinker_steps
    assert edge(data, "0->1", "KV")["payloads"] == REQUESTS
    assert edge(data, "1->2", "stream")["payloads"] == REQUESTS * talker_steps
    assert edge(data, "2->3", "full")["payloads"] == REQUESTS
    for e in data["edges"]:
        assert e["bytes"] > 0 and e["latency_samples"] > 0


@pytest.fixture
def shm_namespace() -> str:
    pytest.importorskip("omni_plugins_shm")
    return f"ex-{uuid.uuid4().hex[:10]}"


def test_pipeline_shm(tmp_path: Path, shm_namespace: str) -> None:
    from omni_plugins_shm.testing import assert_namespace_empty

    data = run_example("pipeline-shm.yaml", tmp_path, {"OMNI_SHM_NAMESPACE": shm_namespace})
    check_speech_edges(data, thinker_steps=32, talker_steps=16)
    assert_namespace_empty(shm_namespace)


def test_pipeline_tp(tmp_path: Path, shm_namespace: str) -> None:
    from omni_plugins_shm.testing import assert_namespace_empty

    data = run_example("pipeline-tp.yaml", tmp_path, {"OMNI_SHM_NAMESPACE": shm_namespace})
    assert edge(data, "0->1", "full")["payloads"] == REQUESTS
    assert edge(data, "0->1", "KV")["payloads"] == REQUESTS  # one merged receive of two shards per request
    assert edge(data, "1->2", "stream")["payloads"] == REQUESTS * 8
    ranks = sorted((s["stage"], s["rank"]) for s in data["stages"])
    assert ranks == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]
    assert_namespace_empty(shm_namespace)


def test_pipeline_redis(tmp_path: Path) -> None:
    testing = pytest.importorskip("omni_plugins_redis.testing")
    with testing.RedisServer(password="example-pw") as server:
        url = f"redis://:example-pw@127.0.0.1:{server.port}/0"
        data = run_example("pipeline-redis.yaml", tmp_path, {"OMNI_REDIS_URL": url})
        assert server.keys("*") == []
    check_speech_edges(data, thinker_steps=16, talker_steps=8)


def test_pipeline_mooncake(tmp_path: Path) -> None:
    testing = pytest.importorskip("omni_plugins_mooncake.testing")
    testing.loopback_environment()
    try:
        master = testing.MooncakeMaster().start()
    except RuntimeError as exc:
        pytest.skip(f"mooncake_master unavailable: {exc}")
    try:
        data = run_example("pipeline-mooncake.yaml", tmp_path, {"OMNI_MOONCAKE_MASTER": master.address})
    finally:
        master.stop()
    check_speech_edges(data, thinker_steps=16, talker_steps=8)


def test_pipeline_hybrid(tmp_path: Path, shm_namespace: str) -> None:
    """thinker -> talker over Redis (stream + KV), talker -> codec over shared memory: one runtime, two connectors."""
    from omni_plugins_shm.testing import assert_namespace_empty

    testing = pytest.importorskip("omni_plugins_redis.testing")
    with testing.RedisServer(password="example-pw") as server:
        url = f"redis://:example-pw@127.0.0.1:{server.port}/0"
        data = run_example("pipeline-hybrid.yaml", tmp_path, {"OMNI_REDIS_URL": url, "OMNI_SHM_NAMESPACE": shm_namespace})
        assert server.keys("*") == []
    assert edge(data, "0->1 net", "stream")["payloads"] == REQUESTS * 16
    assert edge(data, "0->1 net", "KV")["payloads"] == REQUESTS
    assert edge(data, "1->2 local", "stream")["payloads"] == REQUESTS * 8
    assert_namespace_empty(shm_namespace)


def test_pipeline_fanin(tmp_path: Path, shm_namespace: str) -> None:
    from omni_plugins_shm.testing import assert_namespace_empty

    data = run_example("pipeline-fanin.yaml", tmp_path, {"OMNI_SHM_NAMESPACE": shm_namespace})
    assert edge(data, "0->2", "full")["payloads"] == REQUESTS  # one full payload per request and source
    assert edge(data, "1->2", "full")["payloads"] == REQUESTS
    assert edge(data, "2->3", "stream")["payloads"] == REQUESTS * 8
    assert_namespace_empty(shm_namespace)


def test_pipeline_fanout(tmp_path: Path, shm_namespace: str) -> None:
    from omni_plugins_shm.testing import assert_namespace_empty

    data = run_example("pipeline-fanout.yaml", tmp_path, {"OMNI_SHM_NAMESPACE": shm_namespace})
    talker, detok = edge(data, "0->1", "stream"), edge(data, "0->2", "stream")
    assert talker["payloads"] == detok["payloads"] == REQUESTS * 16  # every chunk to both
    assert talker["bytes"] > 100 * detok["bytes"]  # the detokenizer gets the token ids only
    assert edge(data, "0->1", "KV")["payloads"] == REQUESTS and not [e for e in data["edges"] if e["edge"].startswith("0->2") and "KV" in e["edge"]]
    assert_namespace_empty(shm_namespace)


def test_pipeline_pd(tmp_path: Path, shm_namespace: str) -> None:
    from omni_plugins_shm.testing import assert_namespace_empty

    data = run_example("pipeline-pd.yaml", tmp_path, {"OMNI_SHM_NAMESPACE": shm_namespace})
    # least_inflight with two requests in flight: one per prefill replica, each over its own row
    for replica in (0, 1):
        assert edge(data, f"0.r{replica}->1", "full")["payloads"] == 1
        assert edge(data, f"0.r{replica}->1", "KV")["payloads"] == 1
    assert [(r["stage"], r["replica"], r["routed"], r["completed"], r["alive"]) for r in data["replicas"]] == [(0, 0, 1, 1, True), (0, 1, 1, 1, True)]
    assert sorted((s["stage"], s["replica"]) for s in data["stages"]) == [(0, 0), (0, 1), (1, 0)]
    assert_namespace_empty(shm_namespace)
