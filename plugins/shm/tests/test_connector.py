"""In-process behaviour of the shm connector: names, modes, lifetimes, bad segments, gc."""

from __future__ import annotations

import gc as pygc
import json
import os
import stat
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from omni_plugins_shm import gc, notify
from omni_plugins_shm.connector import ShmConnector
from omni_plugins_shm.naming import NAME_MAX, Names, parse_name
from omni_plugins_shm.segments.header import PAYLOAD_OFFSET, Header
from omni_plugins_shm.segments.pool import size_class
from omni_plugins_shm.testing import make_payload, namespace_segments, payload_matches, segment_path

from omni_plugins import create_connector
from omni_plugins.errors import ConfigError, ConnectorError, CorruptPayloadError, WireFormatError

KIB, MIB = 1 << 10, 1 << 20


def _only(namespace: str, kind: str) -> list[str]:
    return [n for n in namespace_segments(namespace) if (p := parse_name(n)) is not None and p.kind == kind]


# -- names ----------------------------------------------------------------------------------
def test_published_names_are_namespaced_and_long_keys_hashed() -> None:
    names = Names("ns1")
    assert names.published("req-1_a.b") == "omnishm.ns1.k.req-1_a.b"
    hashed = names.published("x" * 400)
    assert hashed.startswith("omnishm.ns1.h.") and len(hashed) <= NAME_MAX
    assert names.published("a/b") != names.published("a_b")
    assert names.published("a/b").startswith("omnishm.ns1.h.")
    assert Names("ns2").published("k") != names.published("k")


def test_size_classes_cover_the_request_with_bounded_waste() -> None:
    for n in [1, 4 * KIB, 16 * KIB + 1, MIB + 128, 64 * MIB + 1000, 300 * MIB]:
        cap = size_class(n)
        assert cap >= n and cap % 4096 == 0
        assert cap <= max(16 * KIB, int(n * 1.26) + 4096)


def test_config_is_validated_by_the_core(namespace: str) -> None:
    with pytest.raises(ConfigError):
        create_connector("shm", {"namespace": "has space"})
    with pytest.raises(ConfigError):
        create_connector("shm", {"namespace": namespace, "unknown": 1})
    with create_connector("SharedMemoryConnector", {"namespace": namespace}) as conn:
        assert isinstance(conn, ShmConnector)
        assert conn.capabilities.blocking_get and conn.capabilities.cross_process and conn.capabilities.zero_copy_get


# -- security / cleanup -----------------------------------------------------------------------
def test_segments_and_markers_are_mode_0600(file_pair: Any, namespace: str) -> None:
    producer, consumer = file_pair
    producer.put(0, 1, "k", make_payload(1, 4 * KIB))
    producer.put(0, 1, "big", make_payload(2, MIB))
    consumer.get(0, 1, "k")
    files = namespace_segments(namespace)
    assert {parse_name(n).kind for n in files} >= {"o", "k", "f"}  # type: ignore[union-attr]
    for name in files:
        mode = stat.S_IMODE(os.stat(segment_path(name)).st_mode)
        assert mode == 0o600, f"{name} has mode {oct(mode)}"
    assert stat.S_IMODE(os.stat(f"/dev/shm/{Names(namespace).publish_dir}").st_mode) == 0o700


def test_close_frees_unconsumed_payloads_and_pool(namespace: str) -> None:
    producer = create_connector("shm", {"namespace": namespace, "slot_count": 0, "pool_max_segment_bytes": MIB})
    for i in range(3):
        producer.put(0, 1, f"k{i}", make_payload(i, 64 * KIB))
    producer.put(0, 1, "dedicated", make_payload(9, 2 * MIB))
    assert len(_only(namespace, "k")) == 4
    producer.close()
    assert namespace_segments(namespace) == []


def test_get_consumes_and_returns_segment_to_pool(file_pair: Any, namespace: str) -> None:
    producer, consumer = file_pair
    for i in range(5):
        producer.put(0, 1, "k", make_payload(i, 100 * KIB))
        got = consumer.get(0, 1, "k")
        assert got is not None and payload_matches(got.data, i, 100 * KIB)
    assert producer.health()["pooled_segments"] == 1, "one pooled segment must serve sequential puts"
    assert len(_only(namespace, "f")) == 1 and _only(namespace, "k") == []


def test_put_replaces_an_unconsumed_payload(file_pair: Any, namespace: str) -> None:
    producer, consumer = file_pair
    producer.put(0, 1, "k", {"v": 1})
    producer.put(0, 1, "k", {"v": 2})
    got = consumer.get(0, 1, "k")
    assert got is not None and got.data == {"v": 2}
    assert consumer.get(0, 1, "k") is None


def test_cleanup_frees_and_returns_the_segment(file_pair: Any, namespace: str) -> None:
    producer, consumer = file_pair
    producer.put(0, 1, "k", make_payload(1, 32 * KIB))
    assert consumer.cleanup("k") is True
    assert consumer.cleanup("k") is False
    assert _only(namespace, "k") == [] and len(_only(namespace, "f")) == 1


def test_large_payload_gets_its_own_segment_which_the_get_unlinks(namespace: str) -> None:
    producer = create_connector("shm", {"namespace": namespace, "slot_count": 0, "pool_max_segment_bytes": MIB})
    consumer = create_connector("shm", {"namespace": namespace, "slot_count": 0})
    try:
        producer.put(0, 1, "big", make_payload(3, 3 * MIB))
        assert producer.health()["pooled_segments"] == 0
        got = consumer.get(0, 1, "big")
        assert got is not None and payload_matches(got.data, 3, 3 * MIB)
        assert [n for n in namespace_segments(namespace) if ".o." not in n] == []
    finally:
        producer.close()
        consumer.close()


# -- zero copy ----------------------------------------------------------------------------------
def test_zero_copy_views_pin_the_segment_until_the_last_view_dies(file_pair: Any, namespace: str) -> None:
    producer, consumer = file_pair
    producer.put(0, 1, "a", make_payload(1, 256 * KIB))
    res = consumer.get_views(0, 1, "a")
    assert res is not None
    x = res.data["x"]
    del res
    pygc.collect()
    # the segment is still claimed by the surviving view: the producer must take another one
    for i in range(3):
        producer.put(0, 1, f"b{i}", make_payload(100 + i, 256 * KIB))
    assert producer.health()["pooled_segments"] == 4
    assert torch.equal(x, make_payload(1, 256 * KIB)["x"]), "a live view was overwritten"
    assert len(_only(namespace, "c")) == 1
    for i in range(3):
        assert consumer.get(0, 1, f"b{i}") is not None
    del x
    pygc.collect()
    assert _only(namespace, "c") == [] and len(_only(namespace, "f")) == 4


def test_zero_copy_config_makes_get_return_views(namespace: str) -> None:
    with (
        create_connector("shm", {"namespace": namespace, "slot_count": 0}) as producer,
        create_connector("shm", {"namespace": namespace, "slot_count": 0, "zero_copy": True}) as consumer,
    ):
        producer.put(0, 1, "k", make_payload(1, 64 * KIB))
        got = consumer.get(0, 1, "k")
        assert got is not None
        assert len(_only(namespace, "c")) == 1, "a zero-copy result keeps its segment claimed"
        del got
        pygc.collect()
        assert _only(namespace, "c") == []


def test_views_outlive_close_of_both_connectors(namespace: str) -> None:
    producer = create_connector("shm", {"namespace": namespace, "slot_count": 0})
    consumer = create_connector("shm", {"namespace": namespace, "slot_count": 0})
    producer.put(0, 1, "k", make_payload(5, 128 * KIB))
    res = consumer.get_views(0, 1, "k")
    producer.close()
    consumer.close()
    assert res is not None and payload_matches(res.data, 5, 128 * KIB)
    assert len(namespace_segments(namespace)) == 1
    del res
    pygc.collect()
    assert namespace_segments(namespace) == []


# -- bad segments --------------------------------------------------------------------------------
def _plant(namespace: str, key: str, content: bytes) -> str:
    path = segment_path(Names(namespace).published(key))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, content)
    os.close(fd)
    return path


@pytest.mark.parametrize("content", [b"", b"garbage", os.urandom(4096), b"OMNISHM\x01" + bytes(200)])
def test_garbage_at_a_key_is_a_connector_error_and_removed(pair: Any, namespace: str, content: bytes) -> None:
    _, consumer = pair
    path = _plant(namespace, "bad", content)
    with pytest.raises(ConnectorError, match=r"'bad'.*invalid"):
        consumer.get(0, 1, "bad", timeout=1)
    assert not os.path.exists(path)
    assert consumer.get(0, 1, "bad") is None


def test_segment_for_another_key_is_rejected(file_pair: Any, namespace: str) -> None:
    producer, consumer = file_pair
    producer.put(0, 1, "one", {"v": 1})
    os.rename(segment_path(Names(namespace).published("one")), segment_path(Names(namespace).published("two")))
    with pytest.raises(CorruptPayloadError, match="different key"):  # typed: the runtime fails the request at once
        consumer.get(0, 1, "two")


def test_a_directory_at_a_key_is_a_typed_error_and_removed(file_pair: Any, namespace: str) -> None:
    _, consumer = file_pair
    path = segment_path(Names(namespace).published("d"))
    os.mkdir(path, 0o700)
    with pytest.raises(CorruptPayloadError, match="not a regular file"):
        consumer.get(0, 1, "d")
    assert not os.path.lexists(path) and _only(namespace, "c") == []  # no claimed directory left behind


def test_a_pooled_segment_naming_a_stranger_is_unlinked_not_returned(file_pair: Any, namespace: str) -> None:
    """A (crafted) header naming an owner that is not an open instance: after the get the segment is
    unlinked, not renamed to an ``f.`` name of that owner that nobody would ever free."""
    from omni_plugins_shm.proc import Owner

    producer, consumer = file_pair
    producer.put(0, 1, "k", make_payload(1, 8 * KIB))
    path = segment_path(Names(namespace).published("k"))
    header = gc.read_header(path)
    assert header is not None and header.pooled
    with open(path, "r+b") as fh:
        fh.write(header._replace(owner=Owner(1, 12345, 0xDEADBEEF), seg_no=7).pack())
    got = consumer.get(0, 1, "k")
    assert got is not None and payload_matches(got.data, 1, 8 * KIB)
    assert [n for n in namespace_segments(namespace) if "deadbeef" in n] == []


@pytest.mark.parametrize("zero_copy", [False, True])
def test_corrupt_payload_bytes_raise_wire_format_error(file_pair: Any, namespace: str, zero_copy: bool) -> None:
    producer, consumer = file_pair
    producer.put(0, 1, "k", make_payload(1, 8 * KIB))
    path = segment_path(Names(namespace).published("k"))
    with open(path, "r+b") as fh:  # valid segment header, destroyed wire message
        fh.seek(PAYLOAD_OFFSET)
        fh.write(b"\xff" * 64)
    with pytest.raises(WireFormatError, match="'k'"):
        consumer.get_views(0, 1, "k") if zero_copy else consumer.get(0, 1, "k")
    pygc.collect()
    assert _only(namespace, "c") == [] and _only(namespace, "k") == []


def test_header_round_trip_and_crc() -> None:
    from omni_plugins_shm.proc import Owner
    from omni_plugins_shm.segments.header import HeaderError

    h = Header(Owner(1, 2, 3), 4, 65536, 100, b"d" * 16, True)
    raw = bytearray(h.pack())
    assert Header.unpack(bytes(raw), 65536) == h
    raw[40] ^= 1
    with pytest.raises(HeaderError, match="checksum"):
        Header.unpack(bytes(raw), 65536)
    with pytest.raises(HeaderError, match="capacity"):
        Header.unpack(h.pack(), 4096)


# -- waiting ------------------------------------------------------------------------------------
def test_blocking_get_without_inotify_falls_back(file_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: inotify unavailable (e.g. max_user_instances reached)."""
    import threading

    def broken(path: str) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(notify, "_Watch", broken)
    producer, _ = file_pair
    consumer = ShmConnector(producer.config.model_copy(update={"futex_wait": False}))  # the path without the C extension
    try:
        timer = threading.Timer(0.1, lambda: producer.put(0, 1, "late", {"v": 3}))
        timer.start()
        got = consumer.get(0, 1, "late", timeout=10)
        timer.join()
        assert got is not None and got.data == {"v": 3}
        assert consumer.get(0, 1, "never", timeout=0.05) is None
    finally:
        consumer.close()


def test_waiter_ignores_other_keys(file_pair: Any) -> None:
    import threading

    producer, consumer = file_pair
    timer = threading.Timer(0.05, lambda: [producer.put(0, 1, f"other-{i}", {"i": i}) for i in range(5)])
    timer.start()
    assert consumer.get(0, 1, "mine", timeout=0.3) is None
    timer.join()
    for i in range(5):
        assert consumer.cleanup(f"other-{i}")


# -- gc ------------------------------------------------------------------------------------------
def test_gc_keeps_live_instances_and_reclaims_closed_ones(namespace: str) -> None:
    producer = create_connector("shm", {"namespace": namespace, "slot_count": 0})
    producer.put(0, 1, "k", {"v": 1})
    report = gc.collect(namespace)
    assert report.removed == [] and len(report.kept) == 2
    # a published payload whose producer's marker vanished (instance gone) is garbage
    os.unlink(segment_path(Names(namespace).marker(producer.owner_token)))  # type: ignore[attr-defined]
    report = gc.collect(namespace, dry_run=True)
    assert len(report.removed) == 1 and namespace_segments(namespace)
    report = gc.collect(namespace)
    assert report.removed == [Names(namespace).published("k")]
    producer.close()


def test_gc_and_its_cli_do_not_import_torch() -> None:
    """gc runs where nothing else does (cron, a crashed pipeline's cleanup): its CLI must not pay torch's import
    (~2 s here; it took 4.8 s per ``python -m omni_plugins_shm gc`` before the slot table imported the codec lazily)."""
    code = "import sys, omni_plugins_shm.cli, omni_plugins_shm.gc, omni_plugins_shm.expire; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_gc_cli_all_refuses_next_to_live_instances_and_force_removes_everything(namespace: str) -> None:
    producer = create_connector("shm", {"namespace": namespace, "slot_count": 0})
    producer.put(0, 1, "k", {"v": 1})
    before = namespace_segments(namespace)
    cmd = [sys.executable, "-m", "omni_plugins_shm", "gc", "--namespace", namespace, "--all"]
    refused = subprocess.run(cmd, capture_output=True, text=True)
    assert refused.returncode == 3 and "live connector instance" in refused.stderr and "--force" in refused.stderr
    assert refused.stdout == "" and namespace_segments(namespace) == before  # nothing removed
    out = subprocess.run([*cmd, "--force"], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    # the payload, the marker and the namespace's wake file (held by the live producer: --all takes it too)
    assert sorted(n.split(".")[2] for n in report["removed"]) == ["k", "o", "x"] and report["errors"] == []
    assert namespace_segments(namespace) == []
    producer.close()  # closing after a forced gc must not fail


def test_symlink_at_a_key_is_rejected_without_following_it(pair: Any, namespace: str, tmp_path: Any) -> None:
    _, consumer = pair
    target = tmp_path / "victim"
    target.write_bytes(b"OMNISHM\x01" + bytes(4096))
    link = segment_path(Names(namespace).published("ln"))
    os.symlink(target, link)
    with pytest.raises(CorruptPayloadError, match="not a regular file"):
        consumer.get(0, 1, "ln")
    assert target.exists() and not os.path.lexists(link)


def test_infinite_timeout_waits_and_wakes(pair: Any) -> None:
    import threading

    producer, consumer = pair
    timer = threading.Timer(0.1, lambda: producer.put(0, 1, "inf", {"v": 1}))
    timer.start()
    got = consumer.get(0, 1, "inf", timeout=float("inf"))
    timer.join()
    assert got is not None and got.data == {"v": 1}


def test_publish_directory_lives_as_long_as_an_instance(namespace: str) -> None:
    """Markers keep the publish directory; the last instance to close removes it; a new one recreates it."""
    pubdir = f"/dev/shm/{Names(namespace).publish_dir}"
    first = create_connector("shm", {"namespace": namespace})
    second = create_connector("shm", {"namespace": namespace})
    second.put(0, 1, "k", {"v": 1})
    first.close()
    assert os.path.isdir(pubdir), "a live instance's directory must stay"
    got = second.get(0, 1, "k")
    assert got is not None and got.data == {"v": 1}
    second.close()
    assert not os.path.exists(pubdir)
    with create_connector("shm", {"namespace": namespace}) as third:
        third.put(0, 1, "k", {"v": 2})
        assert third.get(0, 1, "k", timeout=5).data == {"v": 2}  # type: ignore[union-attr]
    assert not os.path.exists(pubdir)


def test_foreign_file_at_the_publish_directory_is_refused(namespace: str) -> None:
    pubdir = f"/dev/shm/{Names(namespace).publish_dir}"
    with open(pubdir, "w"):
        pass
    try:
        with pytest.raises(ConnectorError, match="not a directory"):
            create_connector("shm", {"namespace": namespace})
    finally:
        os.unlink(pubdir)


@pytest.mark.parametrize("slot_count", [0, 256])
def test_waiter_survives_its_directory_being_removed_by_gc_all(namespace: str, slot_count: int) -> None:
    """``gc --all`` next to a waiting get: the watch dies; the waiter falls back to sleeping and still gets the key.

    With the slot table, the new producer publishes into a new table: the waiter must find and open it."""
    import threading

    consumer = create_connector("shm", {"namespace": namespace, "slot_count": slot_count})
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(consumer.get(0, 1, "late", timeout=20)))
    waiter.start()
    time.sleep(0.2)
    gc.collect(namespace, force=True)
    assert not os.path.exists(f"/dev/shm/{Names(namespace).publish_dir}")
    with create_connector("shm", {"namespace": namespace, "slot_count": slot_count}) as producer:
        producer.put(0, 1, "late", {"v": 5})
        waiter.join(20)
    assert not waiter.is_alive() and result and result[0] is not None and result[0].data == {"v": 5}
    consumer.close()
