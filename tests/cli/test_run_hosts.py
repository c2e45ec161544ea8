"""``omni-plugins run`` across hosts, with two "machines" on loopback: the commands the docs give, a host lost mid-run,
refused joins (wrong secret, a host-local edge between hosts), and the control channel's own guarantees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from omni_plugins.ports import free_port

SECRET = "loopback-hosts-secret-0123456789"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _pipeline(tmp_path: Path, net: dict[str, Any], *, steps: int = 4, step_ms: int = 0, placement: str = "") -> Path:
    """stage 0 -> 1 -> 2, every edge over the connector instance ``net`` (a shared backend), streaming."""
    path = tmp_path / f"hosts-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(
        textwrap.dedent(f"""
        connectors:
          net: {{name: redis, extra: {json.dumps(net)}}}
        stages:
          - stage_id: 0
            async_chunk: true
            output_connectors: {{to_stage_1: net}}
            synthetic: {{steps: {steps}, step_ms: {step_ms}, send: stream, outputs: [{{name: a.b, shape: [2, 64]}}]}}
          - stage_id: 1
            async_chunk: true
            input_connectors: {{from_stage_0: net}}
            output_connectors: {{to_stage_2: net}}
            synthetic: {{steps: {steps}, send: stream, outputs: [{{name: c.d, shape: [1, 32]}}]}}
          - stage_id: 2
            async_chunk: true
            final_output: true
            input_connectors: {{from_stage_1: net}}
        """)
        + textwrap.dedent(placement)
    )
    return path


@pytest.fixture
def redis_net(omni_server: Any) -> tuple[dict[str, Any], Any]:
    pytest.importorskip("omni_plugins_redis")
    prefix = f"hosts-{uuid.uuid4().hex[:8]}:"
    server = omni_server("redis")
    return server.connector_config(key_prefix=prefix), server


def _keys(server: Any, prefix: str) -> list[bytes]:
    return list(server.keys(f"{prefix}*")) if hasattr(server, "keys") else []


def _start(path: Path, *args: str, session: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, **(env or {}), "OMNI_CONTROL_SECRET": SECRET}
    cmd = [sys.executable, "-m", "omni_plugins", "run", str(path), "--no-progress", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=session)


def test_the_two_machine_example_runs_as_its_comment_says(tmp_path: Path, omni_server: Any) -> None:
    """examples/pipeline-hosts.yaml, both commands of its comment, with loopback for the two machines' addresses."""
    from omni_plugins_shm.testing import assert_namespace_empty

    pytest.importorskip("omni_plugins_redis")
    server = omni_server("redis")
    net = server.connector_config()
    control = f"127.0.0.1:{free_port()}"
    namespace = f"hosts-{uuid.uuid4().hex[:8]}"
    env = {"OMNI_REDIS_URL": net["url"], "OMNI_CONTROL_ADDRESS": control, "OMNI_SHM_NAMESPACE": namespace}
    if net.get("password"):
        env["OMNI_REDIS_URL"] = net["url"].replace("redis://", f"redis://:{net['password']}@", 1)
    example = EXAMPLES / "pipeline-hosts.yaml"
    a = _start(example, "--host", "gpu-a", "-n", "4", "-c", "2", "--report", str(tmp_path / "a.json"), env=env)
    b = _start(example, "--host", "gpu-b", "--report", str(tmp_path / "b.json"), env=env)
    a_out, a_err = a.communicate(timeout=300)
    b_out, b_err = b.communicate(timeout=60)
    assert a.returncode == 0, a_out + a_err[-3000:]
    assert b.returncode == 0, b_out + b_err[-3000:]
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["ok"] and report["completed"] == 4 and report["leaks"] == [] and report["reclaimed"] == []
    assert [(h["host"], h["stages"], h.get("lost")) for h in report["hosts"]] == [("gpu-a", [0], None), ("gpu-b", [1, 2], None)]
    assert sorted((s["stage"], s["host"]) for s in report["stages"]) == [(0, "gpu-a"), (1, "gpu-b"), (2, "gpu-b")]
    assert {e["edge"]: e["payloads"] for e in report["edges"]} == {
        "0->1 net (stream)": 4 * 16,
        "0->1 net (KV)": 4,
        "1->2 local (stream)": 4 * 8,
    }
    joined = json.loads((tmp_path / "b.json").read_text())
    assert joined["ok"] and joined["stages"] == [1, 2] and "OK: 4/4 requests completed" in joined["report"]
    assert "OK: 4/4 requests completed" in b_out  # the joining machine prints the run's report too
    assert f"serves the control channel on {control}" in a_err and "host gpu-b (127.0.0.1:" in a_err
    assert server.keys("omni-hosts:*") == []
    assert_namespace_empty(namespace)


def test_a_lost_host_fails_its_requests_naming_it_and_the_coordinator_stops_cleanly(
    tmp_path: Path, redis_net: tuple[dict[str, Any], Any]
) -> None:
    """Host b (stages 1, 2) dies with every process it ran while requests are in flight: they fail naming host b, the
    coordinator's own stage stops cleanly, and what b's stages left in the shared backend is reclaimed."""
    net, server = redis_net
    control = f"127.0.0.1:{free_port()}"
    path = _pipeline(tmp_path, net, steps=100000, step_ms=2)  # requests that stay in flight
    a = _start(path, "--stages", "0", "--serve", control, "--host", "a", "-n", "4", "-c", "2", "--report", str(tmp_path / "a.json"))
    b = _start(path, "--stages", "1,2", "--join", control, "--host", "b", session=True)
    try:
        deadline = time.monotonic() + 180
        while not _keys(server, net["key_prefix"]) and time.monotonic() < deadline:  # chunks on the wire: requests admitted
            assert a.poll() is None and b.poll() is None
            time.sleep(0.1)
        time.sleep(0.5)
        os.killpg(b.pid, signal.SIGKILL)  # the machine is gone: every process it ran
        a_out, a_err = a.communicate(timeout=120)
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
        b.communicate(timeout=30)
    assert a.returncode == 1, a_out + a_err[-3000:]
    report = json.loads((tmp_path / "a.json").read_text())
    assert len(report["failed"]) == 2 and len(report["lost"]) == 2  # the two in flight failed; the two never admitted were not run
    for reason in report["failed"].values():
        assert "on host b" in reason and "host b (127.0.0.1:" in reason and "lost" in reason, reason
    assert report["deaths"] and all("on host b" in d for d in report["deaths"]), report["deaths"]
    assert [h["host"] for h in report["hosts"] if h.get("lost")] == ["b"]
    (mine,) = [s for s in report["stages"] if s["host"] == "a"]
    assert mine["leftover_requests"] == 0  # host a's stage stopped cleanly, its aborted requests dropped
    assert not [p for p in report["problems"] if "did not stop" in p]
    assert _keys(server, net["key_prefix"]) == []  # what b's stages left on the shared Redis was reclaimed by host a


def test_a_lost_coordinator_leaves_the_other_host_to_stop_and_clean_up_on_its_own(
    tmp_path: Path, redis_net: tuple[dict[str, Any], Any]
) -> None:
    net, server = redis_net
    control = f"127.0.0.1:{free_port()}"
    path = _pipeline(tmp_path, net, steps=100000, step_ms=2)
    a = _start(path, "--stages", "0", "--serve", control, "--host", "a", "-n", "4", "-c", "2", session=True)
    b = _start(path, "--stages", "1,2", "--join", control, "--host", "b", "--report", str(tmp_path / "b.json"))
    try:
        deadline = time.monotonic() + 180
        while not _keys(server, net["key_prefix"]) and time.monotonic() < deadline:
            assert a.poll() is None and b.poll() is None
            time.sleep(0.1)
        time.sleep(0.5)
        os.killpg(a.pid, signal.SIGKILL)  # the coordinating machine is gone
        b_out, b_err = b.communicate(timeout=120)
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
        a.communicate(timeout=30)
    assert b.returncode == 1, b_out + b_err[-3000:]
    data = json.loads((tmp_path / "b.json").read_text())
    assert not data["ok"] and data["problems"][0].startswith(f"the coordinating host at {control} was lost")
    assert not [p for p in data["problems"] if "did not stop" in p]  # its stages stopped when told, none was killed
    if data["leaks"]:  # what the killed producer left (a commit marker of a put cut short) ...
        assert any("removed" in line for line in data["reclaimed"]), data
    assert _keys(server, net["key_prefix"]) == []  # ... was reclaimed by host b: nothing of the run is left on Redis


def test_a_host_local_edge_between_hosts_is_refused_naming_the_edge_and_both_hosts(tmp_path: Path) -> None:
    from omni_plugins.config import load_pipeline_config
    from omni_plugins.pipeline.checks import plan_for_run
    from omni_plugins.pipeline.launcher import Coordination, Orchestrator, RunOptions

    pytest.importorskip("omni_plugins_shm")
    path = tmp_path / "p.yaml"
    path.write_text(
        textwrap.dedent("""
        connectors: {local: {name: shm, extra: {namespace: never-used}}}
        stages:
          - {stage_id: 0, async_chunk: true, output_connectors: {to_stage_1: local},
             synthetic: {steps: 1, send: stream, outputs: [{name: a.b, shape: [1, 2]}]}}
          - {stage_id: 1, async_chunk: true, input_connectors: {from_stage_0: local}}
        """)
    )
    plan = plan_for_run(load_pipeline_config(path), filename=str(path))
    orch = Orchestrator(plan, RunOptions(), Coordination("a", (0,), "127.0.0.1:0", SECRET.encode(), "digest"))
    try:
        error = orch._join_error("b", [1], {"version": 1, "pipeline": "digest"})
    finally:
        orch.local.close()
    assert error is not None and "edge 0->1" in error and "'local' (shm)" in error and "host 'a'" in error and "host 'b'" in error


def test_validate_refuses_a_placement_with_a_host_local_edge_between_hosts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_plugins.cli import main

    pytest.importorskip("omni_plugins_shm")
    path = tmp_path / "placed.yaml"
    path.write_text(
        textwrap.dedent("""
        connectors:
          local: {name: shm}
          net: {name: redis, extra: {url: "redis://127.0.0.1:1/0"}}
        placement:
          hosts: {a: [0, 1], b: [2]}
        stages:
          - {stage_id: 0, output_connectors: {to_stage_1: local}}
          - {stage_id: 1, input_connectors: {from_stage_0: local}, output_connectors: {to_stage_2: local}}
          - {stage_id: 2, input_connectors: {from_stage_1: local}}
        """)
    )
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "edge 1->2" in err and "stage 1 runs on host 'a' and stage 2 on host 'b'" in err and "edge 0->1" not in err
    path.write_text(path.read_text().replace("to_stage_2: local", "to_stage_2: net").replace("from_stage_1: local", "from_stage_1: net"))
    assert main(["validate", str(path)]) == 0


def test_the_control_channel_refuses_a_wrong_secret_and_reads_nothing_before_the_handshake() -> None:
    import socket

    from omni_plugins.pipeline.control import ControlError, ControlServer, connect

    joined: list[Any] = []
    server = ControlServer("127.0.0.1:0", SECRET.encode(), lambda link, hello: joined.append(hello), handshake_timeout=2)
    try:
        with pytest.raises(ControlError, match="do not share the control secret"):
            connect(server.address, b"another-secret-0123456789abcdef", wait_s=5)
        host, port = server.address.split(":")
        with socket.create_connection((host, int(port)), timeout=5) as raw:  # a join sent without the handshake
            raw.sendall(b"\x00\x00\x00\x10" + b"\x81\xa2op\xa4join" + b"\x00" * 8)
            raw.settimeout(5)
            while raw.recv(4096):  # the challenge, then the refusal; then the server hangs up
                pass
        link = connect(server.address, SECRET.encode(), wait_s=5)
        link.send({"op": "join", "host": "b"})
        deadline = time.monotonic() + 10
        while not joined and time.monotonic() < deadline:
            time.sleep(0.02)
        link.close()
    finally:
        server.close()
    assert joined == [{"op": "join", "host": "b"}]  # only the authenticated one


def test_a_secret_comes_from_the_environment_or_a_file_and_must_be_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_plugins.errors import ConfigError
    from omni_plugins.pipeline.control import load_secret

    monkeypatch.delenv("OMNI_CONTROL_SECRET", raising=False)
    with pytest.raises(ConfigError, match="OMNI_CONTROL_SECRET"):
        load_secret(None)
    monkeypatch.setenv("OMNI_CONTROL_SECRET", "short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(None)
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    assert load_secret(str(secret)) == SECRET.encode()


def test_the_command_line_says_what_is_missing_to_run_part_of_a_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_plugins.cli import main

    path = _pipeline(tmp_path, {"url": "redis://127.0.0.1:1/0"}, placement="placement: {hosts: {a: [0], b: [1, 2]}}\n")
    for args, expected in (
        ([], "places its stages on hosts a, b: say which one this is (--host NAME)"),
        (["--host", "c"], "--host c:"),
        (["--host", "a"], "host a coordinates: give the address to serve the control channel on"),
        (["--host", "b", "--serve", "127.0.0.1:1"], "host a coordinates this pipeline (placement); host b joins it"),
        (["--host", "b", "--stages", "1"], "the placement gives host b stage(s) 1,2"),
    ):
        assert main(["run", str(path), "--no-progress", *args]) == 1
        assert expected in capsys.readouterr().err, args
    bare = _pipeline(tmp_path, {"url": "redis://127.0.0.1:1/0"})
    assert main(["run", str(bare), "--no-progress", "--stages", "1"]) == 1
    assert "either coordinate (--serve HOST:PORT) or join" in capsys.readouterr().err
