"""``mooncake-te`` with real TransferEngines over loopback TCP: roles, failures, the authenticated control channel."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from omni_plugins_mooncake.testing_processes import Child, produce_small, small_payload

from omni_plugins import create_connector
from omni_plugins.contract import Connector
from omni_plugins.errors import ConnectorError

from . import _users

TE = "mooncake-te"
SECRET = "te-test-secret-" + "0123456789abcdef"


@pytest.fixture
def producer() -> Iterator[Connector]:
    with create_connector(TE, {"pool_size": "128MiB"}) as conn:
        yield conn


def consumer_of(*peers: Connector | str, **extra: Any) -> Connector:
    addresses = [p if isinstance(p, str) else p.address for p in peers]  # type: ignore[attr-defined]
    return create_connector(TE, {"listen_address": None, "peers": addresses, **extra})


def _wait_for(predicate: Any, what: str, attempts: int = 200) -> None:
    for _ in range(attempts):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def test_remote_get_consumes_and_frees_the_producer_slab(producer: Connector) -> None:
    with consumer_of(producer) as consumer:
        assert producer.put(0, 1, "k", {"v": torch.arange(100)}).ok
        assert producer.health()["staged"] == 1
        got = consumer.get(0, 1, "k", timeout=5)
        assert got is not None and torch.equal(got.data["v"], torch.arange(100))
        assert consumer.get(0, 1, "k") is None  # consumed at once, even before the producer frees it
        # the reader's "finish" is one-way: the producer frees the slab when it arrives
        _wait_for(lambda: producer.health()["staged"] == 0, "producer freed the consumed payload")
        health = producer.health()
        assert health["being_read"] == 0 and health["staging_pool"]["in_use_bytes"] == 0


def test_one_instance_both_receives_and_sends(producer: Connector) -> None:
    """Stage 1 reads from stage 0 and serves stage 2: listen address plus peers in one config."""
    middle = create_connector(TE, {"peers": [producer.address]})  # type: ignore[attr-defined]
    last = consumer_of(middle)
    try:
        producer.put(0, 1, "req_0_0", {"h": torch.ones(8)})
        got = middle.get(0, 1, "req_0_0", timeout=5)
        assert got is not None
        middle.put(1, 2, "req_1_0", {"h": got.data["h"] * 2})
        out = last.get(1, 2, "req_1_0", timeout=5)
        assert out is not None and torch.equal(out.data["h"], torch.full((8,), 2.0))
    finally:
        last.close()
        middle.close()


def test_consumer_cleanup_frees_the_producer_copy(producer: Connector) -> None:
    with consumer_of(producer) as consumer:
        producer.put(0, 1, "gone", {"v": torch.arange(3)})
        assert consumer.cleanup("gone") is True
        assert producer.health()["staged"] == 0
        assert consumer.get(0, 1, "gone") is None


def test_unconsumed_payload_is_reclaimed_after_ttl() -> None:
    with create_connector(TE, {"payload_ttl": 0.2}) as producer, consumer_of(producer) as consumer:
        producer.put(0, 1, "old", {"v": torch.arange(3)})
        _wait_for(lambda: producer.health()["staged"] == 0, "TTL reclaim")
        assert producer.health()["reclaimed_by_ttl"] == 1
        assert consumer.get(0, 1, "old") is None


def test_dead_peer_is_an_error_not_a_hang() -> None:
    producer = create_connector(TE, {})
    address = producer.address  # type: ignore[attr-defined]
    producer.close()
    with consumer_of(address, socket_timeout=1.0) as consumer:
        with pytest.raises(ConnectorError, match=f"peer {address} is unreachable"):
            consumer.get(0, 1, "k", timeout=2)
        assert consumer.health()["ok"] is False


def test_producer_dying_after_a_claim_makes_the_read_fail() -> None:
    """The claim answer points at memory that vanishes with its process: the read must fail cleanly."""
    producer = create_connector(TE, {"secret": SECRET})
    consumer = consumer_of(producer, socket_timeout=1.0)
    try:
        producer.put(0, 1, "k", {"v": torch.arange(10)})
        from omni_plugins_mooncake.te.control import ControlClient

        client = ControlClient(producer.address, secret=SECRET.encode(), timeout=1)  # type: ignore[attr-defined]
        reply = client.request({"op": "claim", "key": "k"})
        assert reply["found"] is True
        producer.close()
        with pytest.raises(ConnectorError):
            consumer.get(0, 1, "k", timeout=1)
    finally:
        consumer.close()


def test_consume_only_instance_cannot_put() -> None:
    with create_connector(TE, {"listen_address": None}) as conn, pytest.raises(ConnectorError, match="no listen_address"):
        conn.put(0, 1, "k", {"v": 1})


def test_full_staging_pool_is_a_clear_error() -> None:
    with create_connector(TE, {"pool_size": "2MiB"}) as conn:
        assert conn.put(0, 1, "a", {"v": torch.zeros(1 << 18)}).ok  # 1 MiB
        with pytest.raises(ConnectorError, match="registered memory exhausted"):
            conn.put(0, 1, "b", {"v": torch.zeros(1 << 19)})  # 2 MiB more
        assert conn.get(0, 1, "a") is not None  # the earlier payload is intact


def test_short_claim_timeout_uses_acknowledged_finish() -> None:
    """With little claim time left the reader must ask whether its claim held (no one-way finish)."""
    with create_connector(TE, {"claim_timeout": 0.5}) as producer, consumer_of(producer) as consumer:
        producer.put(0, 1, "k", {"v": torch.arange(7)})
        got = consumer.get(0, 1, "k", timeout=5)
        assert got is not None and torch.equal(got.data["v"], torch.arange(7))
        assert producer.health()["staged"] == 0


def test_read_past_its_deadline_strands_the_buffer_and_returns_the_claim(producer: Connector) -> None:
    """A read that may still land later must never have its buffer reused; the payload stays available."""
    from omni_plugins_mooncake.te.transfer import TIMED_OUT

    class _TimesOut:
        def read(self, *args: object) -> int:
            return TIMED_OUT

    with consumer_of(producer) as consumer:
        producer.put(0, 1, "k", {"v": torch.arange(10)})
        reader = consumer._reader  # type: ignore[attr-defined]
        consumer._reader = _TimesOut()  # type: ignore[attr-defined]
        with pytest.raises(ConnectorError, match="did not complete"):
            consumer.get(0, 1, "k")
        health = consumer.health()
        assert health["stranded_receive_buffers"] == 1
        assert health["receive_buffers"]["in_use_bytes"] > 0  # not back in the pool
        stranded = consumer._stranded[0]  # type: ignore[attr-defined]
        consumer._reader = reader  # type: ignore[attr-defined]
        got = consumer.get(0, 1, "k", timeout=5)  # the claim was returned: the payload can be read again
        assert got is not None and torch.equal(got.data["v"], torch.arange(10))
        assert not stranded.address <= got.data["v"].data_ptr() < stranded.address + stranded.size


# -- the control channel is authenticated -----------------------------------------------------------------
# Another local user (uid 65534 when the tests run as root) talks to a producer's control port as the
# security review's reproducer did: without a hello, with a garbage hello, with a wrong secret.
ATTACKER = r"""
import hashlib, hmac, json, os, socket, struct, sys
host, port, variant, discard, claim, rdv = sys.argv[1], int(sys.argv[2]), sys.argv[3], *map(bytes.fromhex, sys.argv[4:6]), sys.argv[6]
out = {"uid": os.getuid(), "replies": [], "closed": False}
if rdv:
    try:
        out["rendezvous"] = [open(os.path.join(rdv, n)).read() for n in os.listdir(rdv)]
    except OSError as exc:
        out["rendezvous"] = type(exc).__name__
s = socket.create_connection((host, port), timeout=5)
s.settimeout(2)
buf = b""
def frame(body):
    return struct.pack(">I", len(body)) + body
def read():
    global buf
    try:
        while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
            data = s.recv(4096)
            if not data:
                out["closed"] = True
                return None
            buf += data
    except ConnectionResetError:
        out["closed"] = True
        return None
    except OSError:
        return None
    n = struct.unpack(">I", buf[:4])[0]
    body, buf = buf[4 : 4 + n], buf[4 + n :]
    return body
challenge = read()
out["challenge"] = challenge[:1].hex() if challenge else None
if variant == "no-hello":
    first = [discard, claim]
elif variant == "garbage-hello":
    first = [b"\x11" + os.urandom(64), discard, claim]
else:  # a well-formed proof made with a wrong secret
    ns, nc = (challenge or b"")[2:], os.urandom(32)
    label = b"omni-plugins mooncake-te control v2 client\x00"
    first = [b"\x11" + nc + hmac.new(b"not-the-secret-0123456789", label + ns + nc, hashlib.sha256).digest()]
s.sendall(b"".join(frame(b) for b in first))
while len(out["replies"]) < 5 and (reply := read()) is not None:
    out["replies"].append(reply.hex())
    try:
        s.sendall(frame(discard) + frame(claim))  # try again after whatever came back
    except OSError:
        pass
print(json.dumps(out))
"""

ATTACKS = ("no-hello", "garbage-hello", "wrong-secret")


def _other_user(argv: list[str]) -> list[str]:
    """``argv`` run as uid/gid 65534 (nobody) when the tests run as root, else as this user (who has no secret either)."""
    if _users.other_user_available() and shutil.which("setpriv"):
        return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    return argv


def _attack(address: str, variant: str, key: str, rendezvous: str = "") -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    discard = msgpack.packb({"v": 1, "op": "discard", "key": key}).hex()
    claim = (b"\x01" + key.encode()).hex()
    argv = _other_user([sys.executable, "-c", ATTACKER, host, port, variant, discard, claim, rendezvous])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": os.environ.get("PATH", "")})
    assert done.returncode == 0, done.stderr[-2000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["uid"] == (65534 if argv[0] == "setpriv" else os.getuid())
    return out


def _assert_refused(out: dict[str, Any]) -> None:
    assert all(r.startswith("13") for r in out["replies"]), out  # a refusal at most: no claim, no discard answered
    assert out["challenge"] == "10", out  # (the server's challenge is all it says before a valid hello)
    assert out["closed"] is True, out  # and it hangs up


def _assert_payload(got: Any, key: str) -> None:
    expected = small_payload(key)
    assert got is not None and torch.equal(got.data["v"], expected["v"]) and got.data["key"] == key


def test_explicit_peers_need_the_configured_secret_and_strangers_are_refused() -> None:
    """Producer and consumer in two processes share a configured secret; nobody else can claim or discard."""
    key = f"private-{uuid.uuid4().hex}"
    with Child(produce_small, {"secret": SECRET, "pool_size": "32MiB"}, key) as child:  # holds the payload until finish()
        address = child.answer()
        for variant in ATTACKS:
            _assert_refused(_attack(address, variant, key))
        with consumer_of(address) as stranger, pytest.raises(ConnectorError, match="no secret for peer"):
            stranger.get(0, 1, key)
        with consumer_of(address, secret="a-different-secret-0123456789") as wrong:
            with pytest.raises(ConnectorError, match="refused this instance's secret"):
                wrong.get(0, 1, key)
            assert wrong.cleanup(key) is False  # its discard is refused too (logged, as any unreachable peer)
            assert wrong.health()["unreachable_peers"] == [address]
        with consumer_of(address, secret=SECRET) as consumer:  # the payload survived all of that
            _assert_payload(consumer.get(0, 1, key, timeout=10), key)
            assert consumer.get(0, 1, key) is None
        result = child.finish()
    assert result["health"]["staged"] == 0 and result["health"]["control_secret"] == "configured"
    for text in [*result["texts"], json.dumps(result["health"])]:
        assert SECRET not in text


def test_rendezvous_without_configuration_works_for_the_user_only(tmp_path: Path) -> None:
    """No secret configured: the producer's generated one sits in its 0600 announcement, readable by this user only."""
    rdv = tmp_path / "peers"
    key = f"private-{uuid.uuid4().hex}"
    with Child(produce_small, {"rendezvous_dir": str(rdv), "pool_size": "32MiB"}, key) as child:
        address = child.answer()
        for variant in ATTACKS:
            out = _attack(address, variant, key, rendezvous=str(rdv))
            if out["uid"] != os.getuid():
                assert out["rendezvous"] == "PermissionError"  # another user cannot read the secret
            _assert_refused(out)
        assert stat.S_IMODE(rdv.stat().st_mode) == 0o700
        (announcement,) = rdv.glob("*.peer")
        assert stat.S_IMODE(announcement.stat().st_mode) == 0o600
        announced, generated = announcement.read_text().split()
        assert announced == address and len(generated) >= 32
        with consumer_of(address) as stranger, pytest.raises(ConnectorError, match="no secret for peer"):
            stranger.get(0, 1, key)  # the address alone is not enough
        with create_connector(TE, {"rendezvous_dir": str(rdv), "listen_address": None}) as consumer:
            _assert_payload(consumer.get(0, 1, key, timeout=10), key)
        result = child.finish()
    assert result["health"]["staged"] == 0 and result["health"]["control_secret"] == "generated"
    for text in [*result["texts"], json.dumps(result["health"])]:
        assert generated not in text
    assert list(rdv.glob("*.peer")) == []  # removed on close


def test_groups_on_one_rendezvous_read_only_their_own_producers(tmp_path: Path) -> None:
    """Two groups of instances (two secrets) announce in one directory: each reads only its own producer's payload
    under a key both hold, a stranger's producer is skipped without failing a get, and nothing is taken from it."""
    rdv = str(tmp_path / "shared")
    other = "te-other-group-secret-0123456789"
    with Child(produce_small, {"secret": other, "rendezvous_dir": rdv, "pool_size": "32MiB"}, "k") as child:
        theirs = child.answer()  # group "other", in its own process, holds small_payload("k")
        with create_connector(TE, {"secret": SECRET, "rendezvous_dir": rdv, "pool_size": "32MiB"}) as ours:
            assert ours.put(0, 1, "k", {"group": "ours"}).ok
            own = {"listen_address": None, "rendezvous_dir": rdv}
            with create_connector(TE, {**own, "secret": SECRET}) as consumer:
                got = consumer.get(0, 1, "k", timeout=10)
                assert got is not None and got.data == {"group": "ours"}
                assert consumer.get(0, 1, "k") is None  # the other group's "k" is not ours: no error, nothing read
                health = consumer.health()
                assert health["ok"] and health["peers"] == [ours.address] and health["skipped_peers"] == [theirs]  # type: ignore[attr-defined]
            with create_connector(TE, own) as no_secret:  # knows no secret for the other group's producer
                assert no_secret.get(0, 1, "k", timeout=0.5) is None
                assert no_secret.health()["skipped_peers"] == [theirs]
            with create_connector(TE, {**own, "secret": other}) as member:  # the other group: skips ours, reads theirs
                _assert_payload(member.get(0, 1, "k", timeout=10), "k")
                assert member.health()["skipped_peers"] == [ours.address]  # type: ignore[attr-defined]
            assert ours.health()["staged"] == 0
        result = child.finish()
    assert result["health"]["staged"] == 0


def test_processes_on_one_host_find_each_other_with_no_configuration() -> None:
    """No peers, no secret, no rendezvous_dir: a consumer process reads from a producer process (the private default directory)."""
    key = f"noconfig-{uuid.uuid4().hex}"
    with Child(produce_small, {}, key) as child:
        address = child.answer()
        with create_connector(TE, {}) as consumer:
            assert address in consumer.health()["peers"]
            _assert_payload(consumer.get(0, 1, key, timeout=10), key)
        result = child.finish()
    assert result["health"]["staged"] == 0 and result["health"]["control_secret"] == "generated"


def test_default_rendezvous_is_private_per_user_and_network_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_plugins_mooncake.te.discovery import default_rendezvous_dir, resolve_rendezvous_dir

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = default_rendezvous_dir()
    assert path == tmp_path / f"omni-plugins-{os.getuid()}" / "mooncake-te" / f"net-{os.stat('/proc/self/ns/net').st_ino}"
    assert stat.S_IMODE((tmp_path / f"omni-plugins-{os.getuid()}").stat().st_mode) == 0o700
    assert resolve_rendezvous_dir("auto") == path and resolve_rendezvous_dir(None) is None
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_rendezvous_dir().parent.parent == runtime / "omni-plugins"
    squatted = tmp_path / "squat"
    squatted.mkdir()
    (squatted / f"omni-plugins-{os.getuid()}").mkdir(mode=0o777)
    os.chmod(squatted / f"omni-plugins-{os.getuid()}", 0o777)
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setattr("tempfile.tempdir", str(squatted))
    with pytest.raises(ConnectorError, match="private to this user"):
        default_rendezvous_dir()


def test_secret_stays_out_of_config_text_and_health(producer: Connector) -> None:
    with create_connector(TE, {"secret": SECRET, "peers": [producer.address]}) as conn:  # type: ignore[attr-defined]
        texts = [repr(conn.config), str(conn.config), conn.config.model_dump_json(), repr(conn.health()), repr(conn)]
        assert all(SECRET not in t for t in texts)
        assert "**********" in repr(conn.config)
