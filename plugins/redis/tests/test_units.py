"""Unit tests without a server: config validation, key naming, manifest parsing, framing and the raw reply reader."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from omni_plugins_redis import manifest as mf
from omni_plugins_redis.config import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, RedisConfig
from omni_plugins_redis.connector import MARKER_TTL_MS, RedisConnector
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.packing import Pieces, frame_key_command, pack, pack_many
from omni_plugins_redis.replies import ProtocolError, ReplyReader
from omni_plugins_redis.sentinel import NewestSentinel
from omni_plugins_redis.waiting import CLAIM_TTL_MS, move_commands
from pydantic import ValidationError
from redis.crc import key_slot
from redis.exceptions import BusyLoadingError, MovedError, NoPermissionError, ResponseError
from redis.sentinel import MasterNotFoundError

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


def test_sentinel_url_names_sentinels_service_and_db() -> None:
    cfg = RedisConfig(url="sentinel://app:s%40cret@10.0.0.1:26380,sentinel-b/mymaster/2")
    assert cfg.sentinels == ["10.0.0.1:26380", "sentinel-b:26379"]
    assert (cfg.service_name, cfg.db, cfg.username) == ("mymaster", 2, "app")
    assert cfg.password is not None and cfg.password.get_secret_value() == "s@cret"
    assert "s@cret" not in str(cfg.url) and "cret" not in cfg.server_label() and "mymaster" in cfg.server_label()
    assert RedisConfig(sentinels=["h:1"], service_name="svc").server_label().startswith("sentinel://h:1/svc")


class _Provider:
    def get_credentials(self) -> tuple[str, str]:
        return ("app", "pw")


provider_instance = _Provider()


def test_credential_provider_is_imported_at_load_time() -> None:
    assert RedisConfig(credential_provider=f"{__name__}:provider_instance").credential_provider
    assert RedisConfig(credential_provider=f"{__name__}:_Provider").credential_provider
    with pytest.raises(ValidationError, match="no attribute"):
        RedisConfig(credential_provider=f"{__name__}:nothing_here")
    with pytest.raises(ValidationError, match="not a redis-py CredentialProvider"):
        RedisConfig(credential_provider="os.path:sep")
    with pytest.raises(ValidationError, match="replaces username/password"):
        RedisConfig(credential_provider=f"{__name__}:provider_instance", password="pw")


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
        {"url": "sentinel://h:1"},  # no service name
        {"url": "sentinel:///svc"},  # no sentinel
        {"sentinels": ["h:1"]},  # no service_name
        {"service_name": "svc"},  # no sentinels
        {"sentinels": ["h:1"], "service_name": "svc", "cluster": True},
        {"min_replica_acks": -1},
        {"replica_ack_timeout": 0},
        {"min_replica_acks": 1, "replica_ack_timeout": 30, "socket_timeout": 30},  # WAIT's reply would time out first
        {"protocol": 4},
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


# -- framing and the raw reply reader -------------------------------------------------


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


def test_one_key_frames_match_pack() -> None:
    key = b"t:{k%7D}:c:ab.1f"
    assert frame_key_command("UNLINK", key) == _joined(pack("UNLINK", key))
    assert frame_key_command("DEL", key) == _joined(pack("DEL", key))


def _reader(sock: socket.socket) -> ReplyReader:
    sock.settimeout(10)
    return ReplyReader(sock, sock.settimeout, 10.0)


def test_reader_parses_replies_and_streams_bulk_into_buffer() -> None:
    a, b = socket.socketpair()
    with a, b:
        payload = bytes(range(256)) * 1000
        stream = b"+OK\r\n:42\r\n$-1\r\n_\r\n*-1\r\n-NOPERM no\r\n-MOVED 7 h:1\r\n-LOADING busy\r\n"
        stream += b"*3\r\n:1\r\n-WRONGTYPE x\r\n$2\r\nab\r\n$%d\r\n" % len(payload)  # EXEC's array, an error inside
        writer = threading.Thread(target=a.sendall, args=(stream + payload + b"\r\n$3\r\nabc\r\n$5\r\nhello\r\n",))
        writer.start()
        reader = _reader(b)
        assert reader.reply() == "OK"
        assert reader.reply() == 42
        assert reader.reply() is None and reader.reply() is None and reader.reply() is None  # RESP2 nil, RESP3 null, timeout
        errors = [reader.reply() for _ in range(3)]
        assert [type(e) for e in errors] == [NoPermissionError, MovedError, BusyLoadingError]  # redis-py's classes
        one, wrong, ab = reader.reply()  # type: ignore[misc]
        assert one == 1 and isinstance(wrong, ResponseError) and wrong.status_code == "WRONGTYPE" and ab == b"ab"
        dest = bytearray(len(payload))
        assert reader.bulk_size() == len(payload)
        reader.body_into(memoryview(dest))
        assert bytes(dest) == payload
        assert reader.bulk_size() == 3
        with pytest.raises(ProtocolError):  # not terminated where the announced size says
            reader.body_into(memoryview(bytearray(2)))
        writer.join(10)


def test_reader_bulk_is_a_fresh_writable_buffer() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"$3\r\nabc\r\n$-1\r\n")
        reader = _reader(b)
        body = reader.reply()
        assert body == b"abc" and isinstance(body, bytearray)
        assert reader.bulk_size() == -1 and reader.buffered == 0


def test_reader_replies_across_buffer_boundaries() -> None:
    """Replies that straddle the reader's buffer end (compaction) or exceed it (growth) parse intact."""
    a, b = socket.socketpair()
    with a, b:
        values = [bytes([i % 251]) * size for i, size in enumerate([65_000, 40_000, 65_530, 3, 1000] * 4)]
        stream = b"".join(b"$%d\r\n%b\r\n" % (len(v), v) for v in values) + b"+" + b"x" * 200_000 + b"\r\n"
        writer = threading.Thread(target=a.sendall, args=(stream,))
        writer.start()
        reader = _reader(b)
        assert [reader.reply() for _ in values] == values
        assert reader.reply() == "x" * 200_000
        writer.join(10)


def test_reader_consumes_a_usual_answer_in_one_match() -> None:
    import re

    a, b = socket.socketpair()
    with a, b:
        reader = _reader(b)
        expected = re.compile(rb"\+OK\r\n:(\d+)\r\n")
        a.sendall(b":1\r\n:0\r\n+OK\r\n:7\r\n")
        assert reader.skip_integers(2) is True  # the deferred deletes' counts
        found = reader.match(expected)
        assert found is not None and found.group(1) == b"7" and reader.buffered == 0
        a.sendall(b"+OK\r\n-ERR x\r\n")
        assert reader.match(expected) is None  # an error reply never matches: nothing consumed
        assert reader.reply() == "OK" and isinstance(reader.reply(), ResponseError)
        a.sendall(b":1\r\n-ERR x\r\n")
        assert reader.skip_integers(2) is False
        assert reader.reply() == 1 and isinstance(reader.reply(), ResponseError)


@pytest.mark.parametrize("line", [b":12x\r\n", b":\r\n", b"$-\r\n", b":" + b"9" * 30 + b"\r\n", b"?1\r\n", b"*x\r\n"])
def test_reader_rejects_malformed_lines(line: bytes) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(line)
        with pytest.raises(ProtocolError):
            _reader(b).reply()


def test_a_silent_server_fails_the_call_in_bounded_time() -> None:
    """A server that accepts and never answers: the call fails with a timeout instead of hanging."""
    from omni_plugins import create_connector
    from omni_plugins.errors import ConnectorError

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        config = {"port": port, "socket_timeout": 0.2, "retry_attempts": 0}
        with create_connector("redis", config) as conn:
            accepted: list[socket.socket] = []
            threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
            with pytest.raises(ConnectorError, match="Timeout"):
                conn.get(0, 1, "k")
            with pytest.raises(ConnectorError, match="Timeout"):
                conn.get(0, 1, "k", timeout=0.1)  # a blocking get's own read bound is enforced the same way
            for peer in accepted:
                peer.close()


# -- Sentinel discovery -------------------------------------------------------------


class _FakeSentinel:
    """A Sentinel's ``SENTINEL MASTERS`` answer (or its failure) for :class:`NewestSentinel`."""

    def __init__(self, answer: dict[str, dict[str, object]] | Exception) -> None:
        self.answer = answer

    def sentinel_masters(self) -> dict[str, dict[str, object]]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _named(port: int, epoch: int, *, down: bool = False) -> dict[str, dict[str, object]]:
    state = {"ip": "127.0.0.1", "port": port, "config-epoch": epoch, "is_master": True, "is_sdown": down, "is_odown": False}
    return {"svc": {**state, "num-other-sentinels": 2}}


def _discover(*answers: dict[str, dict[str, object]] | Exception) -> tuple[str, int]:
    sentinel = NewestSentinel([("127.0.0.1", 1)])
    sentinel.sentinels = [_FakeSentinel(a) for a in answers]  # type: ignore[misc]
    return sentinel.discover_master("svc")


def test_sentinel_discovery_follows_the_newest_epoch_not_the_first_answer() -> None:
    """Right after a failover a Sentinel that has not heard of it names the old primary, back up; the newer epoch wins."""
    assert _discover(_named(7001, 1), _named(7002, 2), _named(7001, 1)) == ("127.0.0.1", 7002)
    assert _discover(redis.ConnectionError("refused"), _named(7002, 2), _named(7001, 1)) == ("127.0.0.1", 7002)
    assert _discover(_named(7003, 3, down=True), _named(7002, 2)) == ("127.0.0.1", 7002), "a primary seen down is skipped"
    with pytest.raises(MasterNotFoundError, match="refused"):
        _discover(redis.ConnectionError("refused"), _named(7001, 1, down=True))
