"""``MooncakeTransferEngineConnector``: producer staging + control server + one-sided reads.

Producer side (``put``): encode into a slab of the registered staging pool and
publish it in the :class:`~.pool.StagingTable`; the control server answers
"where is K". ``put_many`` (a fan-out) encodes once into one slab staged under
every key; each key is claimed and read on its own, and the slab is freed after
the last. Consumer side (``get``): a payload staged by this instance is
decoded in place; otherwise each peer is asked (a binary claim on the control
channel), the payload is read with one one-sided transfer
(:class:`~.transfer.Reader`) into a registered receive slab, the claim is
finished (the producer frees its slab) and the bytes are decoded zero-copy.

Every control connection is authenticated with a shared secret (``control``):
the configured ``secret``, or, when there is none, one each listener generates.
A consumer finds a peer's secret, in this order: the generated secret of a
listener in its own process or in the peer's rendezvous file, then its own
configured secret, then the configured secret of a listener in its own process
(so instances of one process reach each other with no secret configured, while
two groups configured with different secrets stay apart there too).

A producer found through discovery (the rendezvous directory or the roster) is
only a candidate: when this instance knows no secret for it, or the handshake
fails (it refuses this instance's secret, or cannot prove it knows it), it
belongs to another group of instances. It is skipped -- logged at debug, listed
under ``skipped_peers`` in ``health`` -- until it announces itself anew, and no
request of this instance fails because of it. Nothing from it is ever read. Only
a peer listed in ``peers`` that fails the handshake is an error.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from typing import Any

from omni_plugins import wire
from omni_plugins.backoff import poll
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
from omni_plugins.errors import ConnectorError, WireFormatError
from omni_plugins_mooncake._env import prepare_environment
from omni_plugins_mooncake._import import import_mooncake
from omni_plugins_mooncake.config import MooncakeTEConfig
from omni_plugins_mooncake.memory import Slab, SlabPool
from omni_plugins_mooncake.te.control import (
    OP_CLAIM,
    OP_FINISH,
    AuthenticationError,
    Claim,
    ControlClient,
    ControlServer,
    PeerUnreachableError,
    ProtocolError,
    claim_reply,
    parse_key,
    parse_token,
)
from omni_plugins_mooncake.te.discovery import PeerDirectory, PeerEntry, resolve_rendezvous_dir
from omni_plugins_mooncake.te.pool import Staged, StagingTable
from omni_plugins_mooncake.te.roster import MetadataRoster
from omni_plugins_mooncake.te.transfer import DONE, FAILED, TIMED_OUT, Reader

logger = logging.getLogger(__name__)

_CLAIM_MARGIN = 1.0  # seconds of claim left below which the reader asks whether its claim held

# control address -> (secret, whether it was generated) of every listener open in this process: instances of
# one process reach each other without configuring a secret (the secret never leaves the process)
_local_secrets: dict[str, tuple[bytes, bool]] = {}
_local_secrets_lock = threading.Lock()

#: how a discovered address was announced: its rendezvous entry and its roster expiry (None where it is not in
#: one). A skipped address is tried again once this changes (a new announcement, a renewed roster entry).
Announcement = tuple[PeerEntry | None, float | None]


class MooncakeTransferEngineConnector(Connector):
    """Point-to-point connector over a Mooncake ``TransferEngine`` (P2PHANDSHAKE, TCP or RDMA)."""

    capabilities = Capabilities(blocking_get=True, cross_process=True, cross_host=True, zero_copy_get=True, consume_on_get=True)
    config_model = MooncakeTEConfig

    def __init__(self, config: MooncakeTEConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or MooncakeTEConfig()
        engine_mod = import_mooncake("mooncake.engine")
        prepare_environment(cfg.local_hostname)
        te = engine_mod.TransferEngine()
        rc = te.initialize(cfg.local_hostname, "P2PHANDSHAKE", cfg.protocol, cfg.device_name)
        if rc != 0:
            raise ConnectorError(f"mooncake TransferEngine on {cfg.local_hostname} ({cfg.protocol}) failed to initialise: code {rc}")
        self._te = te
        self._reader: Reader | None = Reader(te)
        self._stranded: list[Slab] = []  # receive slabs a timed-out read may still write to: never reused
        self.segment = f"{cfg.local_hostname}:{te.get_rpc_port()}"
        self._send_pool = SlabPool(
            te.register_memory,
            te.unregister_memory,
            name=f"mooncake-te staging pool of {self.segment}",
            max_idle_bytes=int(cfg.max_idle_buffer_bytes),
            max_total_bytes=int(cfg.pool_size),
        )
        self._recv_pool = SlabPool(
            te.register_memory,
            te.unregister_memory,
            name=f"mooncake-te receive buffers of {self.segment}",
            max_idle_bytes=int(cfg.max_idle_buffer_bytes),
        )
        self._table = StagingTable(self._send_pool, ttl=cfg.payload_ttl, claim_timeout=cfg.claim_timeout)
        self._clients: dict[str, ControlClient] = {}
        self._clients_lock = threading.Lock()
        self._server: ControlServer | None = None
        self._directory: PeerDirectory | None = None
        self._roster: MetadataRoster | None = None
        self._announced: dict[str, Announcement] = {}  # discovered (not configured) peer -> its announcement, at the last look
        self._skipped: dict[str, Announcement] = {}  # discovered peer not to ask -> the announcement it was skipped under
        self._stop = threading.Event()
        self._configured_secret: bytes | None = None if cfg.secret is None else cfg.secret.get_secret_value().encode()
        try:
            rendezvous = resolve_rendezvous_dir(cfg.rendezvous_dir)
            if rendezvous is not None:
                self._directory = PeerDirectory(rendezvous)
            if cfg.listen_address is not None:
                generated = None if self._configured_secret is not None else secrets.token_urlsafe(32)
                secret = generated.encode() if generated is not None else self._configured_secret or b""
                self._server = self._listen(cfg.listen_address, secret)
                with _local_secrets_lock:
                    _local_secrets[self._server.address] = (secret, generated is not None)
                if self._directory is not None:
                    # a generated secret goes into the (0600) announcement; a configured one stays out of files
                    self._directory.announce(self._server.address, generated)
                elif generated is not None:
                    logger.info(
                        "mooncake-te %s: no secret configured; the control channel on %s uses a generated one, so only "
                        "instances in this process can read from it (set `secret`, or use rendezvous_dir)",
                        self.segment,
                        self._server.address,
                    )
            if cfg.metadata_server is not None:
                self._roster = MetadataRoster(cfg.metadata_server, cfg.discovery_group, ttl=cfg.discovery_ttl, timeout=cfg.socket_timeout)
                if self._server is not None:
                    self._roster.announce(self._advertised())
                else:
                    self._roster.read()
        except BaseException:
            self._close()
            raise
        interval = max(0.05, min(1.0, cfg.payload_ttl / 4, cfg.claim_timeout / 4))
        self._reaper = threading.Thread(target=self._reap_loop, args=(interval,), name="mooncake-te-reaper", daemon=True)
        self._reaper.start()
        self._discovery: threading.Thread | None = None
        if self._roster is not None:
            self._discovery = threading.Thread(target=self._discovery_loop, name="mooncake-te-discovery", daemon=True)
            self._discovery.start()

    def _advertised(self) -> str:
        """The control address others reach: a wildcard listen host is replaced by ``local_hostname``."""
        assert self._server is not None
        host, _, port = self._server.address.rpartition(":")
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            host = self.config.local_hostname
        return f"{host}:{port}"

    @property
    def address(self) -> str | None:
        """This instance's control address (give it to consumers as a peer), or None when consume-only."""
        return None if self._server is None else self._server.address

    # -- contract ------------------------------------------------------------
    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        return self._put_many([(from_stage, to_stage, key)], data)[0]

    def _put_many(self, targets: list[tuple[str, str, str]], data: Any) -> list[PutResult]:
        """Encode once into one slab, staged under every key (see the module docstring)."""
        if self._server is None:
            keys = ", ".join(repr(key) for _, _, key in targets)
            raise ConnectorError(f"mooncake-te instance {self.segment} has no listen_address, so it cannot serve key {keys}")
        encoded = wire.encode(data)
        n = encoded.nbytes
        slab = self._send_pool.acquire(n)
        try:
            encoded.write_into(slab.view(n))
        except BaseException:
            self._send_pool.release(slab)
            raise
        self._table.stage_many([key for _, _, key in targets], slab, n)
        return [PutResult(True, n, {"peer": self._server.address}) for _ in targets]

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        if not timeout or timeout <= 0:  # one attempt: no closure, no poll frame (as the store connector)
            return self._try_get(key)
        return poll(lambda: self._try_get(key), timeout, self.config.poll_interval)

    def _cleanup(self, key: str) -> bool:
        freed = self._table.discard(key)
        for address, client in self._peer_clients():
            try:
                freed = bool(client.request({"op": "discard", "key": key}).get("released")) or freed
            except PeerUnreachableError as exc:
                self._peer_failed(address, exc)
        return freed

    def _health(self) -> dict[str, Any]:
        unreachable = []
        peers = self._peer_clients()
        for address, client in peers:
            try:
                client.request({"op": "ping"})
            except PeerUnreachableError as exc:
                if self._peer_failed(address, exc):
                    unreachable.append(address)
            except ConnectorError:
                unreachable.append(address)
        with self._clients_lock:
            skipped = sorted(self._skipped)
        return {
            "ok": not unreachable,
            "segment": self.segment,
            "listen_address": self.address,
            "control_secret": self._secret_source(),
            "peers": [a for a, _ in peers if a not in skipped],
            "unreachable_peers": unreachable,
            "skipped_peers": skipped,
            **self._table.stats(),
            "staging_pool": self._send_pool.stats(),
            "receive_buffers": self._recv_pool.stats(),
            "stranded_receive_buffers": len(self._stranded),
            **({} if self._roster is None else {"roster": {"url": self._roster.url, "key": self._roster.key, "peers": len(self._roster.cached())}}),
        }

    def _secret_source(self) -> str:
        """Where this instance's control secret comes from (never the secret itself)."""
        if self._configured_secret is not None:
            return "configured"
        return "none (consume only)" if self._server is None else "generated"

    def _close(self) -> None:
        self._stop.set()
        discovery = getattr(self, "_discovery", None)
        if discovery is not None:
            discovery.join(self.config.socket_timeout * 4 + 1)
        if self._roster is not None and self._server is not None:
            try:
                self._roster.withdraw(self._advertised())
            except ConnectorError as exc:
                logger.warning("mooncake-te %s: could not leave the roster (its entry expires by itself): %s", self.segment, exc)
        if self._directory is not None:
            self._directory.close()
        if self._server is not None:
            with _local_secrets_lock:
                _local_secrets.pop(self._server.address, None)
            self._server.close()
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        self._table.close()
        self._send_pool.close()
        self._recv_pool.close()
        reaper = getattr(self, "_reaper", None)
        if reaper is not None:
            reaper.join(5)
        self._te = None  # the engine (and its listening ports) goes when the last reference does
        self._reader = None
        self._stranded = []

    # -- consumer ---------------------------------------------------------------
    def _try_get(self, key: str) -> GetResult | None:
        self._check_open()
        local = self._table.take(key)
        if local is not None:
            return self._decode_local(local)
        failures: list[str] = []
        for address, client in self._peer_clients():
            claimed_at = time.monotonic()
            try:
                claim = client.claim(key)
            except PeerUnreachableError as exc:
                if self._peer_failed(address, exc):
                    failures.append(str(exc))
                continue
            if claim is not None:
                return self._read_remote(client, key, claim, claimed_at)
        if failures:
            raise ConnectorError(f"mooncake-te: key {key!r} not found and some peers could not be asked: " + "; ".join(failures))
        return None

    def _decode_local(self, entry: Staged) -> GetResult:
        view = self._send_pool.lease(entry.slab, entry.nbytes, None if entry.shared is None else lambda: self._table.release(entry))
        try:
            return GetResult(wire.decode(view), entry.nbytes)
        finally:
            del view

    def _read_remote(self, client: ControlClient, key: str, claim: Claim, claimed_at: float) -> GetResult:
        segment, remote_addr, size, token, claim_ttl = claim
        if not 0 < claim_ttl < 1e9:
            raise ConnectorError(f"mooncake-te peer {client.address} sent a malformed claim for key {key!r}: claim_ttl {claim_ttl}")
        if size <= 0:
            raise ConnectorError(f"mooncake-te peer {client.address} announced key {key!r} with size {size}")
        slab = self._recv_pool.acquire(size)
        try:
            rc = self._read(segment, slab, remote_addr, size, claimed_at + claim_ttl)
            if rc != DONE:
                what = "did not complete before the claim ran out" if rc == TIMED_OUT else "failed"
                raise ConnectorError(f"mooncake-te: reading key {key!r} ({size} bytes) from {segment} (peer {client.address}) {what}")
        except BaseException:
            self._unclaim(client, token)
            raise
        try:
            self._finish(client, key, token, claim_ttl - (time.monotonic() - claimed_at))
        except BaseException:
            self._recv_pool.release(slab)
            raise
        view = self._recv_pool.lease(slab, size)
        try:
            return GetResult(wire.decode(view), size)
        except WireFormatError as exc:
            raise ConnectorError(f"mooncake-te: payload of key {key!r} from peer {client.address} is corrupt: {exc}") from exc
        finally:
            del view

    def _read(self, segment: str, slab: Slab, remote_addr: int, size: int, deadline: float) -> int:
        """One-sided read into ``slab``; on failure the slab goes back to the pool, or is stranded if bytes may still land."""
        rc = TIMED_OUT
        try:
            reader = self._reader  # None once closed (by another thread)
            rc = reader.read(segment, slab.address, remote_addr, size, deadline) if reader is not None else FAILED
        finally:
            if rc == TIMED_OUT:
                with self._clients_lock:
                    self._stranded.append(slab)
                logger.error(
                    "mooncake-te: a read of %d bytes from %s timed out; its %d-byte buffer is kept out of use", size, segment, slab.size
                )
            elif rc != DONE:
                self._recv_pool.release(slab)
        return rc

    def _finish(self, client: ControlClient, key: str, token: int, claim_left: float) -> None:
        """Tell the producer to free the payload; when the claim surely outlived the read, without waiting.

        ``claim_left`` counts from before the claim request was sent, so it underestimates
        the producer's remaining claim time: positive (with a margin) means no one else can
        have been handed the slab, and the one-way message saves a round trip.
        """
        if claim_left > _CLAIM_MARGIN:
            try:
                client.finish(token)
                return
            except PeerUnreachableError as exc:
                logger.warning("mooncake-te: finishing key %r at %s failed (%s); payload reclaimed by its TTL", key, client.address, exc)
                return
        if not client.request({"op": "finish", "token": token}).get("released"):
            raise ConnectorError(
                f"mooncake-te: the claim on key {key!r} at peer {client.address} lapsed during the read "
                f"(claim_timeout); the bytes read were discarded"
            )

    def _unclaim(self, client: ControlClient, token: int) -> None:
        try:
            client.request({"op": "unclaim", "token": token})
        except ConnectorError as exc:
            logger.warning("mooncake-te: could not return a claim to %s: %s", client.address, exc)

    def _peer_clients(self) -> list[tuple[str, ControlClient]]:
        """The peers to ask: configured ones first, then discovered ones not skipped (see the module docstring)."""
        configured = self.config.peers
        entries = {} if self._directory is None else self._directory.peers()
        roster = {} if self._roster is None else self._roster.cached()
        discovered: dict[str, Announcement] = {a: (entries.get(a), roster.get(a)) for a in (*entries, *roster) if a not in configured}
        strangers = [a for a, (entry, _) in discovered.items() if not self._may_share_secret(a, entry)]
        own = self.address
        out = []
        with self._clients_lock:
            self._announced = discovered
            self._skipped = {a: seen for a, seen in self._skipped.items() if discovered.get(a) == seen}
            strangers = [a for a in strangers if a not in self._skipped]
            for address in strangers:
                self._skipped[address] = discovered[address]
            for address in (*configured, *discovered):
                if address == own or address in self._skipped:
                    continue
                client = self._clients.get(address)
                if client is None:
                    client = self._clients[address] = ControlClient(
                        address, secret=functools.partial(self._secret_for, address), timeout=self.config.socket_timeout
                    )
                out.append((address, client))
        for address in strangers:
            logger.debug("mooncake-te %s: skipping discovered peer %s: this instance knows no secret for it", self.segment, address)
        return out

    def _may_share_secret(self, address: str, entry: PeerEntry | None) -> bool:
        """Whether this instance has a secret to offer ``address`` (whether it is the right one, the handshake tells)."""
        if self._configured_secret is not None or (entry is not None and entry.secret is not None):
            return True
        with _local_secrets_lock:
            return address in _local_secrets

    def _secret_for(self, address: str) -> bytes | None:
        """The control secret of the peer at ``address`` (asked when a connection to it opens; order: module docstring)."""
        with _local_secrets_lock:
            local, generated = _local_secrets.get(address, (None, False))
        if local is not None and generated:
            return local
        if self._directory is not None:
            entry = self._directory.peers().get(address)
            if entry is not None and entry.secret is not None:
                return entry.secret.encode()
        return self._configured_secret or local

    def _peer_failed(self, address: str, exc: PeerUnreachableError) -> bool:
        """Handle a peer that failed; True when that is an error (a configured peer), False when it is skipped.

        A discovered address that fails is a stale or foreign announcement: one that fails
        the handshake is another group's producer (skipped until it announces itself anew),
        one that refuses connections leaves the rendezvous directory, and one from the
        roster is skipped until its producer renews its entry (a heartbeat: it is alive again).
        """
        if address in self.config.peers:
            return True
        with self._clients_lock:
            seen = self._announced.get(address)
        if seen is None:
            return True
        entry, expiry = seen
        if isinstance(exc, AuthenticationError):
            logger.debug("mooncake-te %s: skipping discovered peer %s, not one of this instance's group: %s", self.segment, address, exc)
        elif entry is not None and exc.refused:
            assert self._directory is not None
            self._directory.forget(entry)
            seen = (None, expiry)
        elif expiry is not None:
            logger.info("mooncake-te: discovered peer %s failed (%s); skipped until it renews its roster entry", address, exc)
        else:
            return True
        with self._clients_lock:
            self._skipped[address] = seen
            client = self._clients.pop(address, None)
        if client is not None:
            client.close()
        return False

    def _discovery_loop(self) -> None:
        """Refresh the roster every second; a producer renews its entry every third of ``discovery_ttl``."""
        roster = self._roster
        assert roster is not None
        renew_every = roster.ttl / 3
        last_renewal = time.monotonic()
        failing = False
        while not self._stop.wait(1.0):
            try:
                if self._server is not None and time.monotonic() - last_renewal >= renew_every:
                    roster.announce(self._advertised())
                    last_renewal = time.monotonic()
                else:
                    roster.read()
                if failing:
                    logger.warning("mooncake-te %s: metadata server %s reachable again", self.segment, roster.url)
                failing = False
            except ConnectorError as exc:
                if not failing:
                    logger.warning("mooncake-te %s: %s; using the last roster read", self.segment, exc)
                failing = True

    # -- producer ---------------------------------------------------------------
    def _listen(self, address: str, secret: bytes) -> ControlServer:
        try:
            return ControlServer(address, self._handle, secret=secret, fast=self._handle_fast, name=f"mooncake-te {self.segment}")
        except OSError as exc:
            raise ConnectorError(f"mooncake-te cannot listen on {address}: {exc}") from exc

    def _handle_fast(self, body: bytes) -> bytes | None:
        """The binary ``claim`` and one-way ``finish`` (see ``control``): the requests on every ``get``'s path."""
        op = body[0]
        if op == OP_CLAIM:
            entry = self._table.claim(parse_key(body))
            if entry is None:
                return claim_reply(None)
            assert entry.token is not None
            return claim_reply(Claim(self.segment, entry.slab.address, entry.nbytes, entry.token, self._table.claim_timeout))
        if op == OP_FINISH:
            self._table.finish(parse_token(body))
            return None
        raise ProtocolError(f"unknown binary request {op:#x}")

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "claim":
            key = request.get("key")
            if not isinstance(key, str):
                return {"ok": False, "error": "claim needs a string 'key'"}
            entry = self._table.claim(key)
            if entry is None:
                return {"ok": True, "found": False}
            return {
                "ok": True,
                "found": True,
                "segment": self.segment,
                "addr": entry.slab.address,
                "size": entry.nbytes,
                "token": entry.token,
                "claim_ttl": self._table.claim_timeout,
            }
        if op in ("finish", "unclaim"):
            token = request.get("token")
            if not isinstance(token, int):
                return {"ok": False, "error": f"{op} needs an integer 'token'"}
            if op == "finish":
                return {"ok": True, "released": self._table.finish(token)}
            self._table.unclaim(token)
            return {"ok": True}
        if op == "discard":
            key = request.get("key")
            if not isinstance(key, str):
                return {"ok": False, "error": "discard needs a string 'key'"}
            return {"ok": True, "released": self._table.discard(key)}
        if op == "ping":
            return {"ok": True, "segment": self.segment}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                freed = self._table.reap()
            except Exception:
                logger.exception("mooncake-te %s: reaping expired payloads failed", self.segment)
                continue
            if freed:
                logger.warning(
                    "mooncake-te %s: reclaimed %d payload(s) nobody consumed within %.0f s", self.segment, freed, self.config.payload_ttl
                )
