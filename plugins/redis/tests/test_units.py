"""Unit tests without a server: config validation, key naming, manifest parsing, RESP framing."""

from __future__ import annotations

import re
import socket
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_plugins_redis import manifest as mf
from omni_plugins_redis.config import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, RedisConfig
from omni_plugins_redis.connector import MARKER_TTL_MS, RedisConnector
from omni_plugins_redis.framing import Pieces, ProtocolError, ReplyError, ReplyReader, frame_key_command, pack, pack_many, send_buffers
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.waiting import CLAIM_TTL_MS, move_commands
from pydantic import ValidationError
from redis.crc import key_slot

from omni_plugins.errors import ConfigError
from omni_plugins.factory import validate_connector_config

# -- config -------------------------------------------------------------------


def test_url_is_parsed_and_password_hidden() -> None:
    cfg = RedisConfig(url="rediss://app:p%40ss@127.0.0.1:7001/3")
    assert (cfg.host, cfg.port, cfg.db, cfg.username, cfg.tls) == ("127.0.0.1", 7001, 3, "app", True)
    assert cfg.password is not None and cfg.password.get_secret_value() == "p@ss"
    assert "p@ss" not in repr(cfg) and "p%40ss" not in repr(cfg)
    assert "p@ss" not in cfg.server_label() and "pss" not in str(cfg.url)


def test_unix_url() -> None:
    cfg = RedisConfig(url="unix:///run/redis/redis.sock?db=2")
    assert cfg.unix_socket == "/run/redis/redis.sock" and cfg.db == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"url": "http://127.0.0.1:6379"},
        {"url": "redis://127.0.0.1:6379/x"},
        {"url": "redis://127.0.0.1:1/0", "port": 2},
        {"chunk_bytes": 1024},
        {"chunk_bytes": 1 << 30},
        {"inline_bytes": -1},
        {"ttl_seconds": -1},
        {"key_prefix": "a{b}:"},
        {"key_prefix": "a b"},
        {"cluster": True, "unix_socket": "/tmp/x.sock"},
        {"cluster": True, "db": 1},
        {"startup_nodes": ["nohost"]},
        {"tls": True, "tls_ca_file": "/definitely/missing/ca.crt"},
        {"tls_ca_file": "/etc/hostname"},
        {"tls": True, "tls_cert_file": "/etc/hostname"},
        {"pool_size": 0},
        {"socket_timeout": 0},
        {"no_such_field": 1},
    ],
)
def test_bad_configs_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        RedisConfig(**bad)  # type: ignore[arg-type]


def test_registry_error_names_connector_and_field() -> None:
    with pytest.raises(ConfigError) as info:
        validate_connector_config("redis", {"chunk_bytes": 3})
    assert "redis" in str(info.value) and "chunk_bytes" in str(info.value)


def test_password_never_in_validation_error() -> None:
    with pytest.raises(ConfigError) as info:
        validate_connector_config("redis", {"url": "redis://u:hunter2@127.0.0.1:1/0", "pool_size": 0})
    assert "hunter2" not in str(info.value)


# -- keys ---------------------------------------------------------------------


@given(st.text(min_size=1, max_size=40))
@settings(max_examples=200, deadline=None)
def test_all_keys_of_a_payload_share_one_slot(key: str) -> None:
    keys = PayloadKeys("pfx:", key)
    names = [keys.manifest, keys.part("ab" * 8, 0), keys.part("cd" * 8, 17), keys.marker("ab" * 8), keys.claim("ef" * 8)]
    assert len({key_slot(n) for n in names}) == 1
    assert all(n.startswith(b"pfx:") for n in names)


def test_escaping_keeps_keys_distinct() -> None:
    assert PayloadKeys("p:", "a}b").manifest != PayloadKeys("p:", "a%7Db").manifest
    with pytest.raises(ValueError):
        PayloadKeys("p:", "")


# -- manifest -------------------------------------------------------------------


def test_manifest_roundtrip() -> None:
    m = mf.for_parts(10 * 1024 * 1024 + 5, 4 * 1024 * 1024, mf.new_put_id())
    assert mf.parse(m.header(), 1 << 40) == m
    assert [m.part_span(i) for i in range(m.nparts)] == [(0, 4 << 20), (4 << 20, 8 << 20), (8 << 20, (10 << 20) + 5)]
    inline = mf.for_inline(3, mf.new_put_id())
    assert mf.parse(inline.header() + b"abc", 1 << 40).inline


@given(st.binary(max_size=120))
@settings(max_examples=300, deadline=None)
def test_random_manifest_bytes_raise_only_manifest_error(raw: bytes) -> None:
    try:
        mf.parse(raw, 1 << 30)
    except mf.ManifestError:
        pass


def test_manifest_size_cap_and_consistency() -> None:
    pid = b"0123456789abcdef"
    huge = struct.pack("<4sB3xQII16s", b"ORM1", 0, 1 << 50, 1 << 20, 1 << 30, pid)
    with pytest.raises(mf.ManifestError, match="max_payload_bytes"):
        mf.parse(huge, 1 << 40)
    wrong_count = struct.pack("<4sB3xQII16s", b"ORM1", 0, 10 << 20, 4 << 20, 2, pid)
    with pytest.raises(mf.ManifestError, match="inconsistent"):
        mf.parse(wrong_count, 1 << 40)


@pytest.mark.parametrize(
    ("total", "chunk", "nparts", "message"),
    [
        (2**32 - 1, 1, 2**32 - 1, "chunk=1 outside"),  # consistent, but a 40-byte manifest naming 4 billion parts
        (1_000_000, MIN_CHUNK_BYTES - 1, -(-1_000_000 // (MIN_CHUNK_BYTES - 1)), "outside"),
        (60 << 30, 512 << 20, 120, "outside"),  # above MAX_CHUNK_BYTES
        (60 << 30, MIN_CHUNK_BYTES, 2**32 - 1, "inconsistent"),
        (0, MIN_CHUNK_BYTES, 1, "inconsistent"),
    ],
)
def test_manifest_chunk_bounds_the_part_count(total: int, chunk: int, nparts: int, message: str) -> None:
    raw = struct.pack("<4sB3xQII16s", b"ORM1", 0, total, chunk, nparts, b"0123456789abcdef")
    with pytest.raises(mf.ManifestError, match=message):
        mf.parse(raw, 1 << 40)


def test_manifest_part_count_is_bounded_by_the_size_cap() -> None:
    """What passes announces at most ``max_total / MIN_CHUNK_BYTES`` parts."""
    largest = mf.for_parts(1 << 40, MIN_CHUNK_BYTES, "0" * 16)
    assert mf.parse(largest.header(), 1 << 40).nparts == (1 << 40) // MIN_CHUNK_BYTES
    assert mf.parse(mf.for_parts(5, MAX_CHUNK_BYTES, "0" * 16).header(), 1 << 40).nparts == 1


# -- framing -------------------------------------------------------------------


def _joined(buffers: list[bytes | bytearray | memoryview]) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def test_pack_matches_resp() -> None:
    big = memoryview(bytes(range(256)) * 512)
    frames = pack("SET", b"k", Pieces([b"ab", big]), "PX", 5)
    assert _joined(frames) == b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\nab" % (2 + big.nbytes) + bytes(big) + b"\r\n$2\r\nPX\r\n$1\r\n5\r\n"
    assert any(f is big or (isinstance(f, memoryview) and f.obj is big.obj) for f in frames), "big value must not be copied"


@pytest.mark.parametrize("ttl_seconds", [300.0, 0.0])
def test_hot_path_templates_frame_like_pack(ttl_seconds: float) -> None:
    """The one-step framings of the small put and the claim equal what the generic packer makes."""
    connector = RedisConnector(RedisConfig(ttl_seconds=ttl_seconds))
    try:
        manifest, marker, element = b"t:{k}:m", b"t:{k}:w:0123456789abcdef", bytes(range(256)) * 3
        ttl = [("PEXPIRE", manifest, round(ttl_seconds * 1000))] if ttl_seconds else []
        expected = [("MULTI",), ("RPUSH", manifest, element), *ttl, ("SET", marker, b"1", "PX", MARKER_TTL_MS), ("EXEC",)]
        assert connector._inline_commit(manifest, marker, element) == _joined(pack_many(expected))
    finally:
        connector.close()
    claim = b"t:{k}:c:ab.1"
    assert move_commands(manifest, claim) == _joined(
        pack_many([("LMOVE", manifest, claim, "LEFT", "RIGHT"), ("PEXPIRE", claim, CLAIM_TTL_MS)])
    )


def test_reader_skip_consumes_only_a_full_match() -> None:
    a, b = socket.socketpair()
    with a, b:
        reader = ReplyReader(b)
        expected = re.compile(rb"\+OK\r\n:\d+\r\n")
        a.sendall(b"+OK\r\n:1")  # incomplete: nothing consumed, the generic reader takes over
        assert reader.skip(expected) is False
        a.sendall(b"2\r\n+OK\r\n-ERR x\r\n")
        assert reader.read() == "OK" and reader.read() == 12
        assert reader.skip(expected) is False  # an error reply never matches
        assert reader.read() == "OK" and isinstance(reader.read(), ReplyError)
        a.sendall(b"+OK\r\n:7\r\n+PONG\r\n")
        assert reader.skip(expected) is True and reader.read() == "PONG"


def test_reader_parses_replies_and_streams_bulk_into_buffer() -> None:
    a, b = socket.socketpair()
    with a, b:
        payload = bytes(range(256)) * 1000
        frames = [b"+OK\r\n:42\r\n*2\r\n$1\r\nx\r\n$-1\r\n-NOPERM no\r\n$%d\r\n" % len(payload), payload, b"\r\n$3\r\nabc\r\n$-1\r\n"]
        writer = threading.Thread(target=send_buffers, args=(a, frames))
        writer.start()
        reader = ReplyReader(b)
        assert reader.read() == "OK"
        assert reader.read() == 42
        assert reader.read() == [b"x", None]
        err = reader.read()
        assert isinstance(err, ReplyError) and err.code == "NOPERM"
        dest = bytearray(len(payload))
        assert reader.read_bulk_into(memoryview(dest)) is True and bytes(dest) == payload
        with pytest.raises(ProtocolError):
            reader.read_bulk_into(memoryview(bytearray(5)))
        writer.join(10)
    c, d = socket.socketpair()
    with c, d:
        c.sendall(b"$-1\r\n")
        assert ReplyReader(d).read_bulk_into(memoryview(bytearray(3))) is False


def test_one_key_frames_match_pack() -> None:
    key = b"t:{k%7D}:c:ab.1f"
    assert frame_key_command("UNLINK", key) == _joined(pack("UNLINK", key))
    assert frame_key_command("DEL", key) == _joined(pack("DEL", key))


def test_reader_pair_fast_path_and_fallbacks() -> None:
    a, b = socket.socketpair()
    with a, b:
        reader = ReplyReader(b)
        a.sendall(b"$3\r\nabc\r\n:1\r\n")  # LMOVE + PEXPIRE, all arrived: one step, writable copy
        body, expire = reader.read_pair()
        assert body == b"abc" and isinstance(body, bytearray) and expire == 1
        a.sendall(b"$-1\r\n:0\r\n")  # nothing to claim
        assert reader.read_pair() == (None, 0)
        a.sendall(b"-NOPERM no\r\n:1\r\n")
        err, expire = reader.read_pair()
        assert isinstance(err, ReplyError) and err.code == "NOPERM" and expire == 1
        body_bytes = bytes(range(256)) * 20
        a.sendall(b"$%d\r\n" % len(body_bytes) + body_bytes[:100])  # the rest arrives later: generic path
        threading.Timer(0.05, lambda: a.sendall(body_bytes[100:] + b"\r\n:1\r\n")).start()
        body, expire = reader.read_pair()
        assert body == body_bytes and expire == 1
        a.sendall(b":1\r\n:0\r\n+OK\r\n")
        assert reader.skip_integers(2) is True and reader.read() == "OK"
        a.sendall(b":1\r\n-ERR x\r\n")
        assert reader.skip_integers(2) is False  # an error among them: nothing consumed
        assert reader.read() == 1 and isinstance(reader.read(), ReplyError)


def test_reader_replies_across_buffer_boundaries() -> None:
    """Replies that straddle the reader's buffer end (compaction) or exceed it (growth) parse intact."""
    a, b = socket.socketpair()
    with a, b:
        values = [bytes([i % 251]) * size for i, size in enumerate([65_000, 40_000, 65_530, 3, 1000] * 4)]
        stream = b"".join(b"$%d\r\n%b\r\n" % (len(v), v) for v in values) + b"+" + b"x" * 200_000 + b"\r\n"
        writer = threading.Thread(target=a.sendall, args=(stream,))
        writer.start()
        reader = ReplyReader(b)
        assert [reader.read() for _ in values] == values
        assert reader.read() == "x" * 200_000
        writer.join(10)


@pytest.mark.parametrize("line", [b":12x\r\n", b":\r\n", b"$-\r\n", b":" + b"9" * 30 + b"\r\n", b"?1\r\n"])
def test_reader_rejects_malformed_lines(line: bytes) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(line)
        with pytest.raises(ProtocolError):
            ReplyReader(b).read()


def test_kernel_timeouts_bound_a_silent_server() -> None:
    """A server that accepts and never answers: the read fails with TimeoutError instead of hanging."""
    from omni_plugins_redis.client import Address, Connection

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        conn = Connection(Address(host="127.0.0.1", port=port), RedisConfig(socket_timeout=0.2))
        try:
            peer, _ = listener.accept()
            with peer:
                conn.send("PING")
                with pytest.raises(TimeoutError):
                    conn.read()
                with pytest.raises(TimeoutError):
                    conn.read(timeout=0.1)  # a per-read bound (blocking get) is enforced the same way
        finally:
            conn.close()
