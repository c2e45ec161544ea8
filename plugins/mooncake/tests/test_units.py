"""Unit-level tests (no Mooncake engine): import errors, slab leasing, staging table, control framing, removals."""

from __future__ import annotations

import gc
import hashlib
import hmac
import os
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
from omni_plugins_mooncake._direct import Registrations
from omni_plugins_mooncake._import import explain_import_failure
from omni_plugins_mooncake._remover import Remover
from omni_plugins_mooncake.config import MooncakeStoreConfig, MooncakeTEConfig
from omni_plugins_mooncake.memory import SlabPool, size_class
from omni_plugins_mooncake.te import transfer as transfer_module
from omni_plugins_mooncake.te.control import (
    AuthenticationError,
    Claim,
    ControlClient,
    ControlServer,
    PeerUnreachableError,
    ProtocolError,
    claim_reply,
    parse_claim_reply,
    parse_token,
)
from omni_plugins_mooncake.te.discovery import PeerDirectory
from omni_plugins_mooncake.te.pool import StagingTable
from omni_plugins_mooncake.te.transfer import DONE, FAILED, TIMED_OUT, Reader

from omni_plugins import create_connector, wire
from omni_plugins.errors import ConfigError, ConnectorError, PluginLoadError

from . import _users


def _pool(**kw: object) -> tuple[SlabPool, list[int]]:
    registered: list[int] = []

    def register(addr: int, size: int) -> int:
        registered.append(addr)
        return 0

    def unregister(addr: int) -> int:
        registered.remove(addr)
        return 0

    return SlabPool(register, unregister, name="test", **kw), registered  # type: ignore[arg-type]


# -- friendly import errors ------------------------------------------------------
def test_missing_module_names_the_extra() -> None:
    msg = explain_import_failure("mooncake.store", ModuleNotFoundError("No module named 'mooncake'", name="mooncake"))
    assert "omni-plugins-mooncake[cpu]" in msg and "[cuda]" in msg


def test_missing_libibverbs_names_the_debian_package() -> None:
    msg = explain_import_failure("mooncake.engine", ImportError("libibverbs.so.1: cannot open shared object file"))
    assert "apt-get install -y libibverbs1" in msg


def test_cuda_wheel_without_cuda_says_to_switch() -> None:
    msg = explain_import_failure("mooncake.engine", ImportError("libcuda.so.1: cannot open shared object file"))
    assert "mooncake-transfer-engine-non-cuda" not in msg or "[cpu]" in msg
    assert "pip uninstall -y mooncake-transfer-engine" in msg


@pytest.mark.parametrize("name", ["mooncake-store", "mooncake-te"])
def test_connector_without_mooncake_raises_plugin_load_error(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # makes `import mooncake.store` fail
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(PluginLoadError, match=r"omni-plugins-mooncake\[cpu\]"):
        create_connector(name, {"master_address": "127.0.0.1:1"} if name == "mooncake-store" else {})


# -- config ----------------------------------------------------------------------
def test_vllm_omni_field_names_are_accepted() -> None:
    cfg = MooncakeStoreConfig.model_validate(
        {"host": "127.0.0.1", "master": "127.0.0.1:50051", "segment": 1 << 28, "localbuf": "16MiB", "proto": "tcp", "rdma": ""}
    )
    assert cfg.master_address == "127.0.0.1:50051" and cfg.global_segment_size == 1 << 28 and cfg.local_buffer_size == 16 << 20


@pytest.mark.parametrize(
    "name,bad",
    [
        ("mooncake-store", {"protocol": "udp"}),
        ("mooncake-store", {"master_address": "127.0.0.1:99999"}),
        ("mooncake-store", {"global_segment_size": -1}),
        ("mooncake-te", {"peers": ["nohost"]}),
        ("mooncake-te", {"listen_address": "127.0.0.1"}),
        ("mooncake-te", {"payload_ttl": 0}),
    ],
)
def test_bad_configs_are_config_errors(name: str, bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=name):
        create_connector(name, bad)


def test_te_config_defaults_listen_on_loopback() -> None:
    assert MooncakeTEConfig().listen_address == "127.0.0.1:0"


# -- slabs -----------------------------------------------------------------------------
def test_size_classes_waste_at_most_a_quarter() -> None:
    for n in (1, 4096, 1 << 20, (1 << 20) + 1, 3 << 20, (64 << 20) + 512, 100 << 20):
        c = size_class(n, 1 << 20)
        assert c >= n and c % 4096 == 0 and c <= max(n, 1 << 20) * 1.25


def test_pool_reuses_released_slabs() -> None:
    pool, registered = _pool(max_idle_bytes=8 << 20)
    a = pool.acquire(1000)
    pool.release(a)
    b = pool.acquire(2000)
    assert b is a and len(registered) == 1
    pool.release(b)
    pool.close()
    assert registered == []


def test_leased_slab_returns_when_decoded_tensors_die() -> None:
    pool, _ = _pool(max_idle_bytes=8 << 20)
    enc = wire.encode({"t": torch.arange(1000, dtype=torch.int64)})
    slab = pool.acquire(enc.nbytes)
    enc.write_into(slab.view(enc.nbytes))
    view = pool.lease(slab, enc.nbytes)
    out = wire.decode(view)
    del view
    gc.collect()
    assert pool.stats()["in_use_bytes"] == slab.size  # the tensor still points into the slab
    assert pool.acquire(1) is not slab
    assert torch.equal(out["t"], torch.arange(1000))
    del out
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 1 << 20  # only the second acquire is out now


def test_many_leases_all_return_their_slabs() -> None:
    """Each lease hands its slab back exactly once when its exporter dies, however many are out."""
    pool, registered = _pool(max_idle_bytes=64 << 20)
    views = [pool.lease(pool.acquire(1 << 20), 100) for _ in range(8)]
    assert pool.stats()["in_use_bytes"] == 8 << 20
    slabs_before = len(registered)
    del views
    gc.collect()
    assert pool.stats()["in_use_bytes"] == 0
    for _ in range(200):  # reused, never registered again
        view = pool.lease(pool.acquire(1 << 20), 100)
        del view
    assert pool.stats()["in_use_bytes"] == 0 and len(registered) == slabs_before
    pool.close()
    assert registered == []


def test_pool_cap_is_a_clear_error() -> None:
    pool, _ = _pool(max_idle_bytes=0, max_total_bytes=2 << 20)
    pool.acquire(1 << 20)
    pool.acquire(1 << 20)
    with pytest.raises(Exception, match="registered memory exhausted"):
        pool.acquire(1)


# -- staging table ---------------------------------------------------------------------------
def test_claim_is_exclusive_and_finish_frees() -> None:
    pool, _ = _pool(max_idle_bytes=0)
    table = StagingTable(pool, ttl=60, claim_timeout=60)
    table.stage("k", pool.acquire(10), 10)
    first = table.claim("k")
    assert first is not None and first.token is not None
    assert table.claim("k") is None  # a second reader must not get it
    assert table.take("k") is None
    assert table.finish(first.token) is True
    assert table.claim("k") is None and pool.stats()["total_bytes"] == 0


def test_lapsed_claim_becomes_available_and_late_finish_is_refused() -> None:
    pool, _ = _pool(max_idle_bytes=0)
    table = StagingTable(pool, ttl=60, claim_timeout=0.01)
    table.stage("k", pool.acquire(10), 10)
    stale = table.claim("k")
    assert stale is not None and stale.token is not None
    stale_token = stale.token
    time.sleep(0.05)
    table.reap()
    fresh = table.claim("k")  # the reader died: the payload can be claimed again
    assert fresh is not None and fresh.token is not None and fresh.token != stale_token
    assert table.finish(stale_token) is False  # the late reader learns its bytes may be stale
    assert table.finish(fresh.token) is True


def test_ttl_reclaims_unconsumed_payloads() -> None:
    pool, _ = _pool(max_idle_bytes=0)
    table = StagingTable(pool, ttl=0.01, claim_timeout=60)
    table.stage("k", pool.acquire(10), 10)
    time.sleep(0.05)
    assert table.reap() == 1
    assert table.stats()["staged"] == 0 and pool.stats()["total_bytes"] == 0


def test_replacing_a_payload_being_read_defers_the_free() -> None:
    pool, _ = _pool(max_idle_bytes=0)
    table = StagingTable(pool, ttl=60, claim_timeout=60)
    old_slab = pool.acquire(10)
    table.stage("k", old_slab, 10)
    claim = table.claim("k")
    assert claim is not None and claim.token is not None
    table.stage("k", pool.acquire(20), 20)
    assert pool.stats()["total_bytes"] == 2 << 20  # the old slab is still being read
    assert table.finish(claim.token) is True
    assert pool.stats()["total_bytes"] == 1 << 20
    new = table.take("k")
    assert new is not None and new.nbytes == 20


# -- control channel ---------------------------------------------------------------------------------
SECRET = b"unit-test-secret-0123456789abcdef"


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _read_frame(s: socket.socket) -> bytes | None:
    """One frame's body, or None when the server closed the connection (or reset it) first."""
    buf = b""
    try:
        while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
            data = s.recv(4096)
            if not data:
                return None
            buf += data
    except ConnectionResetError:
        return None
    return buf[4:]


def _client_handshake(s: socket.socket, secret: bytes) -> bytes:
    """The handshake as docs/backends/mooncake.md writes it (independent of the module's code); returns the verdict body."""
    challenge = _read_frame(s)
    assert challenge is not None and challenge[:2] == b"\x10\x02" and len(challenge) == 34
    ns, nc = challenge[2:], os.urandom(32)
    proof = hmac.new(secret, b"omni-plugins mooncake-te control v2 client\0" + ns + nc, hashlib.sha256).digest()
    s.sendall(_frame(b"\x11" + nc + proof))
    verdict = _read_frame(s)
    assert verdict is not None
    if verdict[:1] == b"\x12":
        server_proof = hmac.new(secret, b"omni-plugins mooncake-te control v2 server\0" + ns + nc, hashlib.sha256).digest()
        assert verdict[1:] == server_proof
    return verdict


def _connect(server: ControlServer, secret: bytes | None = SECRET) -> socket.socket:
    """A raw connection to ``server``, through the handshake when ``secret`` is given."""
    host, port = server.address.split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.settimeout(5)
    if secret is not None:
        assert _client_handshake(s, secret)[:1] == b"\x12"
    return s


def test_control_server_survives_garbage_and_answers() -> None:
    server = ControlServer("127.0.0.1:0", lambda req: {"ok": True, "echo": req.get("op")}, secret=SECRET, idle_timeout=2)
    try:
        for junk in (b"\xff\xff\xff\xff", struct.pack(">I", 3) + b"\xc1\xc1\xc1", struct.pack(">I", 1) + b"\x01"):
            with _connect(server) as s:  # authenticated, then garbage
                s.sendall(junk)
                assert s.recv(16) == b""  # the server hangs up on a bad frame
        client = ControlClient(server.address, secret=SECRET, timeout=2)
        assert client.request({"op": "ping"})["echo"] == "ping"
        client.close()
    finally:
        server.close()


def test_binary_claim_and_finish_round_trip_and_bad_frames_drop_the_client() -> None:
    """The binary claim/finish (every get's path): answers, one-way finish, and malformed requests hang up."""
    seen: list[bytes] = []

    def fast(body: bytes) -> bytes | None:
        seen.append(body)
        if body[0] == 0x02:
            parse_token(body)
            return None
        if body[0] != 0x01:
            raise ProtocolError(f"unknown binary request {body[0]:#x}")  # as the connector's handler does
        key = body[1:].decode()
        return claim_reply(Claim("127.0.0.1:15001", 4096, 1 << 20, 7, 60.0) if key == "k" else None)

    server = ControlServer("127.0.0.1:0", lambda req: {"ok": True, "echo": req.get("op")}, secret=SECRET, fast=fast, idle_timeout=2)
    try:
        client = ControlClient(server.address, secret=SECRET, timeout=2)
        assert client.claim("k") == Claim("127.0.0.1:15001", 4096, 1 << 20, 7, 60.0)
        assert client.claim("other") is None
        client.finish(7)  # one-way: the next request on the same connection still gets its own answer
        assert client.request({"op": "ping"})["echo"] == "ping"
        assert seen[-1] == b"\x02" + (7).to_bytes(8, "big")
        for junk in (b"\x02\x00", b"\x7f", b""):  # short finish, unknown binary op, empty frame
            with _connect(server) as s:
                s.sendall(struct.pack(">I", len(junk)) + junk)
                assert s.recv(16) == b""
        client.close()
    finally:
        server.close()


def _recording_server(**kw: object) -> tuple[ControlServer, list[object]]:
    """A server whose handlers record every request they are asked to serve (none may arrive unauthenticated)."""
    served: list[object] = []

    def handler(req: dict[str, object]) -> dict[str, object]:
        served.append(req)
        return {"ok": True, "released": True}

    def fast(body: bytes) -> bytes | None:
        served.append(body)
        return claim_reply(Claim("127.0.0.1:15001", 4096, 1 << 20, 7, 60.0))

    return ControlServer("127.0.0.1:0", handler, secret=SECRET, fast=fast, **kw), served  # type: ignore[arg-type]


DISCARD = msgpack.packb({"v": 1, "op": "discard", "key": "k"})


@pytest.mark.parametrize(
    "first_frame",
    [
        pytest.param(DISCARD, id="discard-without-hello"),
        pytest.param(b"\x01k", id="binary-claim-without-hello"),
        pytest.param(b"\x11" + bytes(64), id="hello-of-zeros"),
        pytest.param(b"\x11" + os.urandom(64), id="random-hello"),
        pytest.param(b"\x11" + os.urandom(20), id="short-hello"),
        pytest.param(b"\x11" + os.urandom(200), id="long-hello"),
    ],
)
def test_control_server_serves_nothing_before_a_valid_hello(first_frame: bytes) -> None:
    """Before a valid hello the server sends only its challenge and a refusal, then closes; no handler runs."""
    server, served = _recording_server()
    try:
        with _connect(server, secret=None) as s:
            challenge = _read_frame(s)
            assert challenge is not None and challenge[:1] == b"\x10"
            s.sendall(_frame(first_frame) + _frame(DISCARD) + _frame(b"\x01k"))  # and requests right behind it
            verdict = _read_frame(s)
            assert verdict is None or verdict.startswith(b"\x13")  # refused (or reset), never an answer
            assert _read_frame(s) is None  # closed
        assert served == []
    finally:
        server.close()


def test_control_server_refuses_a_wrong_secret_and_serves_the_right_one() -> None:
    server, served = _recording_server()
    try:
        with _connect(server, secret=None) as s:
            assert _client_handshake(s, b"wrong-secret-0123456789abcdef")[:1] == b"\x13"  # refused
            try:
                s.sendall(_frame(DISCARD))
            except OSError:
                pass
            assert _read_frame(s) is None
        wrong = ControlClient(server.address, secret=b"wrong-secret-0123456789abcdef", timeout=2)
        with pytest.raises(AuthenticationError, match="refused this instance's secret"):
            wrong.request({"op": "discard", "key": "k"})
        with pytest.raises(AuthenticationError):
            wrong.claim("k")
        wrong.close()
        assert served == []
        with _connect(server) as s:  # the documented handshake, then a request
            s.sendall(_frame(DISCARD))
            reply = _read_frame(s)
            assert reply is not None and msgpack.unpackb(reply) == {"ok": True, "released": True}
        assert served == [{"v": 1, "op": "discard", "key": "k"}]
    finally:
        server.close()


def test_a_silent_client_is_dropped_after_the_handshake_timeout() -> None:
    server, served = _recording_server(handshake_timeout=0.3)
    try:
        with _connect(server, secret=None) as s:
            assert (_read_frame(s) or b"")[:1] == b"\x10"
            started = time.monotonic()
            assert _read_frame(s) is None  # no hello: closed
            assert time.monotonic() - started < 4
        assert served == []
    finally:
        server.close()


def test_connections_waiting_in_the_handshake_are_capped() -> None:
    server, _ = _recording_server(max_pending=2, handshake_timeout=5)
    try:
        idle = [_connect(server, secret=None) for _ in range(2)]
        for s in idle:
            assert (_read_frame(s) or b"")[:1] == b"\x10"
        with _connect(server, secret=None) as extra:
            assert _read_frame(extra) is None  # closed at once, no challenge
        client = ControlClient(server.address, secret=SECRET, timeout=2)
        with pytest.raises(PeerUnreachableError):
            client.request({"op": "ping"})  # also turned away while the two hold their slots
        for s in idle:
            s.close()
        for _ in range(100):  # their threads notice the close and free the slots
            try:
                assert client.request({"op": "ping"})["ok"] is True
                break
            except PeerUnreachableError:
                time.sleep(0.05)
        else:
            raise AssertionError("slots never freed")
        client.close()
    finally:
        server.close()


def test_client_without_a_secret_does_not_authenticate() -> None:
    server, served = _recording_server()
    try:
        client = ControlClient(server.address, secret=lambda: None, timeout=2)
        with pytest.raises(AuthenticationError, match="no secret for peer"):
            client.request({"op": "discard", "key": "k"})
        assert served == []
    finally:
        server.close()


def test_client_refuses_a_server_that_does_not_know_the_secret() -> None:
    """A process squatting a producer's port cannot feed a consumer fake claims: the server must prove the secret too."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        address = f"127.0.0.1:{fake.getsockname()[1]}"

        def impostor() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.sendall(_frame(b"\x10\x02" + os.urandom(32)))
                _read_frame(conn)
                conn.sendall(_frame(b"\x12" + os.urandom(32)))  # "accepted", with a proof it cannot make
                _read_frame(conn)

        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        client = ControlClient(address, secret=SECRET, timeout=2)
        with pytest.raises(AuthenticationError, match="does not know the secret"):
            client.claim("k")
        client.close()
        thread.join(5)


def test_control_server_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="secret"):
        ControlServer("127.0.0.1:0", lambda req: {"ok": True}, secret=b"")


@pytest.mark.parametrize("body", [b"", b"\x01short", b"\x03", b"\x01" + bytes(32) + b"\xff"])
def test_malformed_claim_reply_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_claim_reply(body, "peer:1")


def test_silent_peer_times_out_instead_of_hanging() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog) but never answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        client = ControlClient(address, secret=SECRET, timeout=0.3)
        with pytest.raises(Exception, match="unreachable"):
            client.request({"op": "claim", "key": "k"})
        client.close()


# -- control secret: config and the rendezvous directory ---------------------------------------------
def test_te_secret_is_hidden_validated_and_optional() -> None:
    secret = "config-secret-" + "x" * 20
    cfg = MooncakeTEConfig.model_validate({"secret": secret})
    assert cfg.secret is not None and cfg.secret.get_secret_value() == secret
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), repr(cfg.model_dump())):
        assert secret not in text
    assert MooncakeTEConfig.model_validate({"secret": ""}).secret is None  # `${VAR:-}` with VAR unset
    with pytest.raises(ConfigError, match="at least 16 characters") as err:
        create_connector("mooncake-te", {"secret": "tooshort"})
    assert "tooshort" not in str(err.value)


def test_rendezvous_dir_must_be_private(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConnectorError, match="private to this user"):
        PeerDirectory(shared)
    fresh = PeerDirectory(tmp_path / "new" / "peers")
    assert stat.S_IMODE(os.stat(fresh.path).st_mode) == 0o700
    fresh.announce("127.0.0.1:7", "generated-secret")
    (announced,) = fresh.path.glob("*.peer")
    assert stat.S_IMODE(os.stat(announced).st_mode) == 0o600


def test_rendezvous_entries_carry_secrets_and_other_users_files_are_ignored(tmp_path: Path) -> None:
    mine, reader = PeerDirectory(tmp_path / "peers"), PeerDirectory(tmp_path / "peers")
    mine.announce("127.0.0.1:7001", "generated-secret")
    (reader.path / "old.peer").write_text("127.0.0.1:7002")  # an announcement without a secret (configured one)
    peers = reader.peers()
    assert peers["127.0.0.1:7001"].secret == "generated-secret" and peers["127.0.0.1:7002"].secret is None
    if _users.other_user_available():  # a file another user managed to place is not trusted
        planted = reader.path / "planted.peer"
        planted.write_text("127.0.0.1:7003\nattacker-chosen\n")
        os.chown(planted, 65534, 65534)
        assert "127.0.0.1:7003" not in reader.peers()
    mine.close()
    assert "127.0.0.1:7001" not in reader.peers()


@pytest.mark.parametrize(
    "alias,name",
    [
        ("MooncakeStoreConnector", "mooncake-store"),
        ("MooncakeConnector", "mooncake-store"),
        ("MooncakeTransferEngineConnector", "mooncake-te"),
    ],
)
def test_vllm_omni_class_names_resolve(alias: str, name: str) -> None:
    from omni_plugins.factory import resolve_connector

    spec = resolve_connector(alias)
    assert spec.name == name and spec.distribution == "omni-plugins-mooncake"


# -- background removal of consumed store objects ------------------------------------
class _FakeStore:
    """Records removals; ``gate`` holds the remover thread inside a removal until set."""

    def __init__(self) -> None:
        self.removed: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.codes: dict[str, int] = {}

    def one(self, key: str) -> int:
        self.gate.wait(10)
        self.removed.append([key])
        return self.codes.get(key, 0)

    def many(self, keys: list[str]) -> list[int]:
        self.gate.wait(10)
        self.removed.append(list(keys))
        return [self.codes.get(k, 0) for k in keys]


def _remover(store: _FakeStore, failures: list[tuple[str, int]]) -> Remover:
    return Remover(store.one, store.many, lambda k, rc: failures.append((k, rc)), name="test-remover")


def test_remover_removes_in_the_background_and_batches_what_queued_up() -> None:
    store, failures = _FakeStore(), []
    remover = _remover(store, failures)
    try:
        store.gate.clear()  # hold the thread inside the first removal
        remover.submit("a")
        deadline = time.monotonic() + 10
        while not store.removed and time.monotonic() < deadline:
            remover.submit("b")  # queued behind the held removal
            remover.submit("c")
            time.sleep(0.01)
            if remover.pending("a"):
                break
        assert remover.pending("a") and remover.pending("b") and remover.pending("c")
        store.gate.set()
        assert remover.flush(10)
        assert not remover.pending("a") and len(remover) == 0
        flat = [k for batch in store.removed for k in batch]
        assert sorted(flat) == ["a", "b", "c"]
        assert any(len(batch) > 1 for batch in store.removed) or len(store.removed) == 3
        assert failures == []
    finally:
        remover.close()


def test_settle_removes_a_queued_key_before_returning() -> None:
    store, failures = _FakeStore(), []

    def one(key: str) -> int:  # only "held" waits for the gate
        return store.one(key) if key == "held" else (store.removed.append([key]) or 0)

    remover = Remover(one, store.many, lambda k, rc: failures.append((k, rc)), name="test-remover")
    try:
        store.gate.clear()
        remover.submit("held")  # the thread takes this one and blocks in it
        deadline = time.monotonic() + 10
        while remover._queued and time.monotonic() < deadline:
            time.sleep(0.005)
        remover.submit("k")  # queued behind it
        assert remover.settle("k") is True  # removed here and now, not left to the blocked thread
        assert not remover.pending("k") and ["k"] in store.removed
        assert remover.settle("k") is False
        assert remover.pending("held")
        threading.Timer(0.2, store.gate.set).start()
        assert remover.settle("held") is True  # in flight: waits for the thread to finish it
        assert not remover.pending("held") and ["held"] in store.removed
        assert failures == []
    finally:
        store.gate.set()
        remover.close()


def test_remover_reports_failures_and_survives_exceptions() -> None:
    store, failures = _FakeStore(), []
    store.codes["bad"] = -900

    def boom(key: str) -> int:
        if key == "explodes":
            raise RuntimeError("store gone")
        return store.one(key)

    remover = Remover(boom, store.many, lambda k, rc: failures.append((k, rc)), name="test-remover")
    try:
        remover.submit("explodes")
        assert remover.flush(10)
        remover.submit("bad")
        assert remover.flush(10)
        remover.submit("fine")
        assert remover.flush(10)
        assert ("explodes", -1) in failures and ("bad", -900) in failures
        assert all(k != "fine" for k, _ in failures)
    finally:
        remover.close()


def test_closed_remover_removes_synchronously() -> None:
    store, failures = _FakeStore(), []
    remover = _remover(store, failures)
    remover.submit("a")
    remover.close()
    assert ["a"] in store.removed and len(remover) == 0
    remover.submit("late")  # e.g. a get racing close: still removed, at once
    assert ["late"] in store.removed


# -- one-sided reads that wait without spinning ---------------------------------------
class _FakeEngine:
    """``batch_transfer_async_read`` returns ``batch``; ``transfer_check_status`` replays ``statuses`` (last one repeats)."""

    def __init__(self, statuses: list[int], batch: int = 7) -> None:
        self.statuses = statuses
        self.batch = batch
        self.submitted: list[tuple[str, list[int], list[int], list[int]]] = []
        self.checks = 0

    def batch_transfer_async_read(self, segment: str, local: list[int], remote: list[int], sizes: list[int]) -> int:
        self.submitted.append((segment, local, remote, sizes))
        return self.batch

    def transfer_check_status(self, batch: int) -> int:
        assert batch == self.batch
        status = self.statuses[min(self.checks, len(self.statuses) - 1)]
        self.checks += 1
        return status


@pytest.mark.parametrize(
    ("statuses", "batch", "expected"),
    [
        ([0, 0, 1], 7, DONE),  # completes after two pending checks
        ([0, -1], 7, FAILED),  # the engine reports failure (and freed the batch)
        ([1], 0, FAILED),  # the submit failed: nothing to wait for
        ([1], -1, FAILED),
        ([0, -2], 7, TIMED_OUT),  # the engine's own timeout: slices may still land
    ],
)
def test_reader_maps_engine_statuses(statuses: list[int], batch: int, expected: int) -> None:
    engine = _FakeEngine(statuses, batch)
    assert Reader(engine).read("peer:1", 100, 200, 4096, time.monotonic() + 10) == expected
    assert engine.submitted == [("peer:1", [100], [200], [4096])]


def test_reader_gives_up_at_its_deadline_instead_of_hanging() -> None:
    engine = _FakeEngine([0])  # never completes
    started = time.monotonic()
    assert Reader(engine).read("peer:1", 100, 200, 64 << 20, started + 0.2) == TIMED_OUT
    assert engine.checks >= 1
    assert time.monotonic() - started < 5


def test_reader_sleeps_through_half_of_a_long_read_and_only_yields_for_a_short_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long read is not polled from the start (that would keep a core busy); a short one never sleeps."""
    sleeps: list[float] = []
    monkeypatch.setattr(transfer_module.time, "sleep", sleeps.append)
    reader = Reader(_FakeEngine([0, 0, 1]), initial_rate=1e9)
    assert reader.read("peer:1", 100, 200, 64 << 20, time.monotonic() + 10) == DONE  # ~67 ms expected at 1 GB/s
    assert len(sleeps) == 1 and sleeps[0] == pytest.approx((64 << 20) / 1e9 / 2, rel=0.01)
    sleeps.clear()
    reader = Reader(_FakeEngine([0, 0, 1]), initial_rate=1e9)
    assert reader.read("peer:1", 100, 200, 1 << 20, time.monotonic() + 10) == DONE  # ~1 ms expected
    assert sleeps == []


def test_registrations_are_counted_and_a_failure_undoes_the_batch() -> None:
    calls: list[tuple[str, int]] = []

    def register(addr: int, size: int) -> int:
        calls.append(("reg", addr))
        return -1 if addr == 99 else 0

    def unregister(addr: int) -> int:
        calls.append(("unreg", addr))
        return 0

    regs = Registrations(register, unregister)
    assert regs.acquire([(1, 10), (2, 10)])
    assert regs.acquire([(1, 10)])  # shared with a second put: counted, not registered twice
    assert calls == [("reg", 1), ("reg", 2)]
    assert not regs.acquire([(3, 10), (99, 10)])  # the failure undoes the batch's earlier registration
    assert calls[-2:] == [("reg", 99), ("unreg", 3)]
    regs.release([(1, 10), (2, 10)])
    assert len(regs) == 1 and calls[-1] == ("unreg", 2)
    regs.release([(1, 10)])
    assert len(regs) == 0 and calls[-1] == ("unreg", 1)


# -- cross-host discovery: the roster on the metadata server ---------------------------------------------
def test_metadata_server_discovery_needs_a_secret_and_an_http_url() -> None:
    with pytest.raises(ValueError, match="configured secret"):
        MooncakeTEConfig.model_validate({"metadata_server": "http://10.0.0.1:8080/metadata"})
    with pytest.raises(ValueError, match="HTTP metadata server"):
        MooncakeTEConfig.model_validate({"metadata_server": "etcd://10.0.0.1:2379", "secret": "s" * 20})
    for off in ("P2PHANDSHAKE", "", None):
        assert MooncakeTEConfig.model_validate({"metadata_server": off}).metadata_server is None
    with pytest.raises(ValueError, match="discovery_group"):
        MooncakeTEConfig.model_validate({"discovery_group": "../x"})


def test_roster_entries_from_the_server_are_untrusted() -> None:
    from omni_plugins_mooncake.te.roster import _parse

    assert _parse(b"\xff") == {} and _parse(b"[1]") == {} and _parse(b'{"peers": [1]}') == {}
    got = _parse(b'{"v": 1, "peers": {"10.0.0.1:7": 5, "10.0.0.2:7": "x", "10.0.0.3:7": true, "10.0.0.4:7": 2.5}}')
    assert got == {"10.0.0.1:7": 5.0, "10.0.0.4:7": 2.5}


def test_roster_read_modify_write_and_expiry(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_plugins_mooncake.te.roster import MetadataRoster

    store: dict[str, bytes] = {}
    now = [1000.0]
    roster = MetadataRoster("http://127.0.0.1:1/metadata", "g", ttl=30, clock=lambda: now[0])

    def fake(method: str, body: bytes | None = None) -> bytes | None:
        if method == "PUT":
            store[roster.key] = body or b""
        elif method == "DELETE":
            store.pop(roster.key, None)
        return store.get(roster.key) if method == "GET" else b"ok"

    monkeypatch.setattr(roster, "_request", fake)
    roster.announce("10.0.0.1:7")
    roster.announce("10.0.0.2:7")
    assert roster.read() == {"10.0.0.1:7": 1030.0, "10.0.0.2:7": 1030.0}
    now[0] = 1020.0
    roster.announce("10.0.0.2:7")  # renewed
    now[0] = 1040.0
    assert list(roster.cached()) == ["10.0.0.2:7"] and list(roster.read()) == ["10.0.0.2:7"]  # the other expired
    roster.withdraw("10.0.0.2:7")
    assert roster.key not in store  # the last one out deletes the roster
    assert roster.key == "omni-plugins/mooncake-te/g/roster"
