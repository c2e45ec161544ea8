"""The leak checks of ``omni-plugins run`` see real leftovers in real backends."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_plugins.config import load_pipeline_config
from omni_plugins.pipeline.leaks import backend_leaks, health_leaks, reclaim

from .conftest import tiny_pipeline


def test_shm_leftover_segment_is_reported(tmp_path: Path, shm_ns: str) -> None:
    from omni_plugins import create_connector

    config = load_pipeline_config(tiny_pipeline(tmp_path, extra=f"{{namespace: {shm_ns}}}"))
    assert backend_leaks(config, {"c"}, "abc123") == []
    producer = create_connector("shm", {"namespace": shm_ns, "pool_bytes": 0})
    try:
        producer.put(0, 1, "never-read", {"x": list(range(10))})
        leaks = backend_leaks(config, {"c"}, "abc123")
        assert len(leaks) == 1 and shm_ns in leaks[0] and "shm file" in leaks[0]
        assert producer.cleanup("never-read")
    finally:
        producer.close()
    assert backend_leaks(config, {"c"}, "abc123") == []


def test_redis_leftover_key_is_reported(tmp_path: Path) -> None:
    testing = pytest.importorskip("omni_plugins_redis.testing")
    with testing.RedisServer(password="pw") as server:
        url = f"redis://:pw@127.0.0.1:{server.port}/0"
        config = load_pipeline_config(tiny_pipeline(tmp_path, name="redis", extra=f'{{url: "{url}", key_prefix: "lk:"}}'))
        assert backend_leaks(config, {"c"}, "abc123") == []
        client = server.client()
        client.set("lk:orphan", b"x")
        client.set("other:key", b"y")  # another prefix is not ours
        leaks = backend_leaks(config, {"c"}, "abc123")
        client.close()
        assert len(leaks) == 1 and "1 Redis key(s)" in leaks[0] and "lk:orphan" in leaks[0]


def test_redis_reclaim_deletes_only_this_runs_keys(tmp_path: Path) -> None:
    testing = pytest.importorskip("omni_plugins_redis.testing")
    with testing.RedisServer() as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        config = load_pipeline_config(tiny_pipeline(tmp_path, name="redis", extra=f'{{url: "{url}", key_prefix: "l*k:"}}'))
        client = server.client()
        mine = [b"l*k:{req-abc123-00001_0_0}:m", b"l*k:{req-abc123-00002_0_3}:p:x:0"]
        theirs = [b"l*k:{req-zzz999-00001_0_0}:m", b"lXk:{req-abc123-00001_0_0}:m", b"other:{req-abc123-00001_0_0}:m"]
        for key in mine + theirs:
            client.set(key, b"x")
        assert reclaim(config, {"c"}, "abc123") == ["connector 'c': removed 2 Redis key(s) of this run"]
        left = sorted(client.keys("*"))
        client.close()
        assert left == sorted(theirs)  # another run's keys, and a prefix the glob '*' must not match, stay


def test_shm_reclaim_frees_a_dead_process_files_only(tmp_path: Path, shm_ns: str) -> None:
    import multiprocessing as mp

    from omni_plugins_shm.testing import namespace_segments

    config = load_pipeline_config(tiny_pipeline(tmp_path, extra=f"{{namespace: {shm_ns}}}"))
    child = mp.get_context("spawn").Process(target=_put_and_die, args=(shm_ns,))
    child.start()
    child.join(60)
    assert child.exitcode == -9
    from omni_plugins import create_connector

    live = create_connector("shm", {"namespace": shm_ns, "pool_bytes": 0, "slot_count": 0, "reclaim_on_start": False})
    try:
        live.put(0, 1, "live-key", {"x": 1})
        before = namespace_segments(shm_ns)
        assert any("dead-key" in n for n in before) and any("live-key" in n for n in before)
        lines = reclaim(config, {"c"}, "anytag")
        assert len(lines) == 1 and "removed" in lines[0]
        after = namespace_segments(shm_ns)
        assert not any("dead-key" in n for n in after) and any("live-key" in n for n in after)  # a live owner's payload stays
        assert live.cleanup("live-key")
    finally:
        live.close()


def _put_and_die(namespace: str) -> None:
    import os
    import signal

    from omni_plugins import create_connector

    conn = create_connector("shm", {"namespace": namespace, "pool_bytes": 0, "slot_count": 0})
    conn.put(0, 1, "dead-key", {"x": list(range(10))})
    os.kill(os.getpid(), signal.SIGKILL)


def test_health_fields_of_held_payloads() -> None:
    assert health_leaks("stage 0 rank 0", {"ok": True, "staged": 0}) == []
    assert health_leaks("stage 0 rank 0", {"ok": True, "staged": 2, "being_read": 1}) == [
        "stage 0 rank 0: connector still holds 2 staged payload(s)",
        "stage 0 rank 0: connector still holds 1 being_read payload(s)",
    ]


def test_mooncake_store_check_removes_only_this_runs_objects(tmp_path: Path) -> None:
    """The store cannot count keys by pattern without removing them: the check removes this run's, and nobody else's."""
    pytest.importorskip("mooncake.store")
    from mooncake.store import MooncakeDistributedStore
    from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment

    loopback_environment()
    with MooncakeMaster() as master:
        config = load_pipeline_config(tiny_pipeline(tmp_path, name="mooncake-store", extra=f'{{master_address: "{master.address}"}}'))
        client = MooncakeDistributedStore()
        assert client.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.address) == 0
        try:
            mine = ["req-abc123-00001_0_0", "req-abc123-00002_1_0_0_1"]  # a chunk key and a KV shard key of run abc123
            theirs = ["req-abc1234-00001_0_0", "req-zzz999-00001_0_0", "other_0_0", "xreq-abc123-00001_0_0"]
            for key in mine + theirs:
                assert client.put(key, b"payload") == 0
            assert master.key_count() == 6
            leaks = backend_leaks(config, {"c"}, "abc123")
            assert leaks == [f"connector 'c': 2 store object(s) of this run left on {master.address} (removed)"]
            assert [client.is_exist(k) for k in mine] == [0, 0]
            assert [client.is_exist(k) for k in theirs] == [1, 1, 1, 1]
            assert backend_leaks(config, {"c"}, "abc123") == []
            [failed] = backend_leaks(config, {"c"}, ".*")  # a tag that would widen the pattern is refused
            assert "leak check failed" in failed and "alphanumeric" in failed
            assert master.key_count() == 4
        finally:
            client.remove_all(True)
            client.close()
