"""``omni-plugins run`` with its stages spread over three test hosts, and network faults under a running pipeline.

Hosts a, b and c; Redis and mooncake_master run on c. A hybrid pipeline moves
every payload over a different backend per edge (Redis with KV, shared memory
inside host b, mooncake-te, mooncake-store), its five stages on all three
hosts, clean and under 5 % packet loss plus 20 ms delay. Then a 10 s
partition of the service host (Redis's, then mooncake_master's) while a
pipeline between a and b has requests in flight: every request completes or
fails with a typed reason, every stage stops, nothing acknowledged is lost,
nothing is left behind.
"""

from __future__ import annotations

import json
import queue
import textwrap
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _pipelines
import pytest

from omni_plugins.testing.netns import TestNetwork
from omni_plugins.testing.processes import process_context

if TYPE_CHECKING:
    from conftest import Service  # this directory's (the fixtures' type); not imported at run time: another
    # directory's conftest may be the module named "conftest" then

SECRET = b"netns-pipeline-secret-0123456789"
TE_SECRET = "netns-pipeline-te-secret-0123456789"
PARTITION = 10.0


def _run(network: TestNetwork, path: Path, placement: dict[str, list[int]], run: dict[str, Any], *, during: Any = None) -> dict[str, Any]:
    """Coordinate from the first host of ``placement``, join from the others; the coordinator's report (every host ended well)."""
    ctx = process_context()
    out = ctx.Queue()
    names = list(placement)
    here = network.host(names[0])
    serve = f"{here.address}:{here.free_port()}"
    expected = {name: placement[name] for name in names[1:]}
    procs = [here.process(ctx, _pipelines.coordinate, str(path), here.address, names[0], placement[names[0]], serve, SECRET, run, expected, out)]
    for name in names[1:]:
        host = network.host(name)
        procs.append(host.process(ctx, _pipelines.join, str(path), host.address, name, placement[name], serve, SECRET, out))
    for proc in procs:
        proc.start()
    results: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 300
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                kind, name, data = out.get(timeout=1)
            except queue.Empty:
                continue
            assert kind != "error", f"host {name}: {data}"
            if kind == "feeding":
                if during is not None:
                    during()  # while the requests run (the hosts go on meanwhile)
                continue
            results[name] = data
    finally:
        for proc in procs:
            proc.join(60)
    assert set(results) == set(names), f"hosts that did not finish: {set(names) - set(results)}"
    report = dict(results[names[0]])
    for name in names[1:]:  # each joining host stopped cleanly, found nothing left, and ended as the run did
        assert results[name] == {"ok": report["ok"], "problems": [], "leaks": [], "reclaimed": []}, (name, results[name])
    return report


def _hybrid(tmp_path: Path, redis: Service, master: Service) -> tuple[Path, str]:
    """The pipeline file, and its Redis key prefix."""
    path = tmp_path / f"hybrid-{uuid.uuid4().hex[:6]}.yaml"
    prefix = f"hy-{uuid.uuid4().hex[:8]}:"
    redis_extra = {"url": f"redis://{redis.address}/0", "password": redis.extra["password"], "key_prefix": prefix}
    path.write_text(
        textwrap.dedent(f"""
        # thinker (a) -redis: stream + KV-> talker (b) -shm-> codec (b) -mooncake-te-> vocoder (c) -mooncake-store-> output (a)
        connectors:
          redis: {{name: redis, extra: {json.dumps(redis_extra)}}}
          local: {{name: shm, extra: {{namespace: hy-{uuid.uuid4().hex[:8]}, pool_bytes: 33554432}}}}
          te:
            name: mooncake-te
            extra:
              local_hostname: ${{OMNI_HOST_ADDRESS}}
              listen_address: ${{OMNI_HOST_ADDRESS}}:0
              metadata_server: {master.extra["metadata_url"]}
              discovery_group: hy{uuid.uuid4().hex[:8]}
              rendezvous_dir: null
              secret: {TE_SECRET}
              pool_size: 32MiB
          store:
            name: mooncake-store
            extra: {{master_address: "{master.address}", local_hostname: "${{OMNI_HOST_ADDRESS}}", global_segment_size: 64MiB,
                     local_buffer_size: 16MiB}}
        stages:
          - stage_id: 0
            model_stage: thinker
            async_chunk: true
            kv_transfer: true
            output_connectors: {{to_stage_1: redis}}
            synthetic:
              steps: 6
              send: stream
              outputs: [{{name: hidden.states, shape: [1, 2048], dtype: bfloat16}}]
              kv: {{layers: 2, heads: 4, head_dim: 64, tokens: 32, block_size: 16, dtype: bfloat16}}
          - stage_id: 1
            model_stage: talker
            async_chunk: true
            kv_transfer: true
            input_connectors: {{from_stage_0: redis}}
            output_connectors: {{to_stage_2: local}}
            synthetic: {{steps: 4, send: stream, outputs: [{{name: codes.audio, shape: [2, 16], dtype: int64}}]}}
          - stage_id: 2
            model_stage: codec
            worker_type: generation
            async_chunk: true
            input_connectors: {{from_stage_1: local}}
            output_connectors: {{to_stage_3: te}}
            synthetic: {{steps: 2, send: full, outputs: [{{name: audio.wave, shape: [1, 8192], dtype: float32}}]}}
          - stage_id: 3
            model_stage: vocoder
            input_connectors: {{from_stage_2: te}}
            output_connectors: {{to_stage_4: store}}
            synthetic: {{steps: 2, send: full, outputs: [{{name: audio.pcm, shape: [1, 65536], dtype: int16}}]}}
          - stage_id: 4
            model_stage: output
            final_output: true
            input_connectors: {{from_stage_3: store}}
        """)
    )
    return path, prefix


def _redis_keys(redis: Service, prefix: str) -> int:
    import redis as redis_py

    client = redis_py.Redis(host=redis.host.address, port=redis.port, password=str(redis.extra["password"]), socket_timeout=10)
    try:
        return len(list(client.scan_iter(match=f"{prefix}*")))
    finally:
        client.close()


def _clean(report: dict[str, Any]) -> None:
    assert report["ok"], json.dumps({k: report[k] for k in ("failed", "lost", "deaths", "leaks", "problems", "edges")}, indent=1)
    assert report["mismatches"] == 0 and report["leaks"] == [] and report["reclaimed"] == []


@pytest.mark.parametrize("impaired", [False, True], ids=["clean", "loss5-delay20ms"])
def test_a_hybrid_pipeline_on_three_hosts_over_redis_mooncake_te_and_store(
    network: TestNetwork, redis_on_c: Service, master_on_c: Service, tmp_path: Path, impaired: bool
) -> None:
    path, prefix = _hybrid(tmp_path, redis_on_c, master_on_c)
    if impaired:
        network.impair(loss=0.05, delay=0.02, seed=7)
    try:
        report = _run(network, path, {"a": [0, 4], "b": [1, 2], "c": [3]}, {"requests": 4, "concurrency": 2, "stall_s": 120})
    finally:
        network.clear_impairments()
    _clean(report)
    assert report["completed"] == 4
    assert {e["edge"]: e["payloads"] for e in report["edges"]} == {
        "0->1 redis (stream)": 4 * 6,
        "0->1 redis (KV)": 4,
        "1->2 local (stream)": 4 * 4,
        "2->3 te (full)": 4,
        "3->4 store (full)": 4,
    }
    assert sorted((s["stage"], s["host"]) for s in report["stages"]) == [(0, "a"), (1, "b"), (2, "b"), (3, "c"), (4, "a")]
    assert sorted((h["host"], h.get("lost")) for h in report["hosts"]) == [("a", None), ("b", None), ("c", None)]
    assert _redis_keys(redis_on_c, prefix) == 0
    assert master_on_c.master_key_count() == 0


def _chain(tmp_path: Path, name: str, extra: dict[str, Any]) -> Path:
    """stage 0 (host a) streams to stage 1 (host b) over ``name``; each request takes a while, so several are in flight."""
    path = tmp_path / f"chain-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(
        textwrap.dedent(f"""
        connectors:
          net: {{name: {name}, extra: {json.dumps(extra)}}}
        stages:
          - stage_id: 0
            async_chunk: true
            output_connectors: {{to_stage_1: net}}
            synthetic: {{steps: 12, step_ms: 50, send: stream, outputs: [{{name: hidden.states, shape: [4, 4096], dtype: bfloat16}}]}}
          - stage_id: 1
            async_chunk: true
            final_output: true
            recv_timeout_s: 20
            input_connectors: {{from_stage_0: net}}
        """)
    )
    return path


def _reachable(network: TestNetwork, service: Service) -> bool:
    import sys

    probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"
    return network.host("a").run([sys.executable, "-c", probe, service.host.address, str(service.port)], check=False).returncode == 0


#: a failed request says why: its input timed out, or a transfer failed (never silently lost)
TYPED = ("timed out waiting for input", "the runtime reported it failed", "was not enqueued", "aborted (failed elsewhere)")


@pytest.mark.parametrize("name", ["redis", "mooncake-store"])
def test_a_10s_partition_from_the_service_host_under_a_running_pipeline(
    network: TestNetwork, tmp_path: Path, name: str, request: pytest.FixtureRequest
) -> None:
    """Cut host c (Redis / mooncake_master) off for 10 s while stage 0 on a streams to stage 1 on b."""
    service: Service = request.getfixturevalue("redis_on_c" if name == "redis" else "master_on_c")
    prefix = f"part-{uuid.uuid4().hex[:8]}:"
    if name == "redis":
        extra = {"url": f"redis://{service.address}/0", "password": service.extra["password"], "key_prefix": prefix}
        extra |= {"connect_timeout": 2.0, "socket_timeout": 3.0}
    else:
        extra = {"master_address": service.address, "local_hostname": "${OMNI_HOST_ADDRESS}", "global_segment_size": "64MiB"}
        extra |= {"local_buffer_size": "16MiB", "connect_timeout": 2.0}
    path = _chain(tmp_path, name, extra).resolve()
    cut_off: list[bool] = []

    def partition() -> None:
        time.sleep(0.5)  # the first requests are streaming (each takes at least 12 steps of 50 ms, 3 at a time)
        network.cut(service.host)
        try:
            cut_off.append(not _reachable(network, service))
            time.sleep(PARTITION)
        finally:
            network.heal(service.host)

    requests = 12
    report = _run(network, path, {"a": [0], "b": [1]}, {"requests": requests, "concurrency": 3, "stall_s": 120}, during=partition)
    summary = json.dumps({k: report[k] for k in ("completed", "failed", "lost", "deaths", "problems", "leaks", "reclaimed")}, indent=1)
    assert cut_off == [True]  # the partition was real
    assert report["lost"] == [] and report["completed"] + len(report["failed"]) == requests, summary  # every request: an outcome
    for reason in report["failed"].values():
        assert any(t in reason for t in TYPED), reason
    assert report["deaths"] == [] and report["problems"] == []  # every stage stopped (no thread hung), nothing killed
    assert report["mismatches"] == 0  # what was delivered is intact
    assert report["leaks"] == [], summary  # nothing left in a runtime, a connector or the backend
    assert report["completed"] > 0
    if name == "redis":
        assert _redis_keys(service, prefix) == 0
    else:
        assert service.master_key_count() == 0
