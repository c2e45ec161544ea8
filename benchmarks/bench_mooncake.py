"""Mooncake connectors against the raw Mooncake APIs, measured in the same run.

One process, a fresh loopback ``mooncake_master`` (or ``--master host:port``), two
endpoints per backend (producer and consumer, each its own engine/client, talking
over TCP on 127.0.0.1). Per payload size (1, 16, 64 MiB of uint8), every
iteration runs all variants in a shuffled order so machine noise hits them alike:

- ``store_raw``: ``put_from`` a pre-filled registered buffer (placed in the
  putter's own segment, as the connector does), then ``get_into`` another
  registered buffer (the object is removed afterwards, untimed).
- ``store``: ``mooncake-store`` ``put`` then ``get`` of ``{"x": tensor}`` (encode,
  ``upsert_from``, ``get_into``, zero-copy decode; the forced remove of the
  consumed key runs on the connector's background thread, in whatever variant
  comes next).
- ``te_raw_read`` / ``te_raw_write``: one ``transfer_sync_read`` (consumer pulls)
  and one ``transfer_sync_write`` (producer pushes) between registered buffers.
- ``te_raw_async_read``: the same raw read submitted with
  ``batch_transfer_async_read`` and waited for with short sleeps, exactly as the
  connector waits (``omni_plugins_mooncake.te.transfer.Reader``). The sync call
  spins a core until the transfer completes, which on a 2-core machine slows
  the transfer itself; this variant separates the connector's own overhead
  from that waiting strategy.
- ``te``: ``mooncake-te`` ``put`` then ``get`` (encode into the staging pool, claim
  over the control channel, one-sided read, finish, zero-copy decode).
- floor parts, timed in the same rounds: ``stage_copy`` (``wire.encode`` +
  ``write_into`` a registered, reused slab: the one copy both connectors must
  make because ``put`` may not keep the caller's memory) and ``control_rtt``
  (one binary ``claim`` round trip on ``mooncake-te``'s control channel, for a
  key the producer does not have: the lookup as the connector makes it) and ``bare_rtt``
  (16 bytes to a Python thread that only echoes them, over a blocking loopback
  TCP socket: the least any consumer pays to learn from a producer process
  where a key is, without framing, parsing or bookkeeping). ``floor`` ratios are
  the best a connector doing only that could reach: raw / (best raw read + those
  parts); ``te_floor_min_vs_raw_read`` uses ``bare_rtt``, and
  ``te_floor_copy_only_vs_raw_read`` leaves the lookup out entirely (an upper
  bound for any connector that copies once and reads once). ``decode`` (a
  zero-copy ``wire.decode`` of the encoded payload lying in memory, as a
  ``get`` must return tensors, not bytes) is timed too; ``*_floor_all`` add it:
  store raw + copy + decode, te best read + copy + bare round trip + decode.
  (``store`` skips the staging copy for new keys of 4 MiB and more, so its
  floor applies to the 1 MiB size only.)

Ratios are raw time / connector time (1.0 = as fast as raw; target >= 0.8).
The target ratios (``target_ratios`` in the JSON) compare like with like, the
raw calls moving the same bytes once: ``store`` vs ``store_raw`` (put_from +
get_into) and ``te`` vs ``te_raw_read`` (one ``transfer_sync_read``, the raw
call a pull uses). Also reported, not targets: ``store`` vs raw plus the forced
remove a consuming reader needs too; ``te`` vs ``te_raw_async_read`` (the raw
read waited for as the connector waits: the connector's overhead alone); ``te``
vs ``te_raw_write + te_raw_read`` (moves the bytes twice). Segments and buffers
are warmed first.

    python benchmarks/bench_mooncake.py [--quick] [--json FILE] [--plot FILE.png] [--master HOST:PORT]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import mmap
import os
import platform
import random
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from omni_plugins_mooncake.te.control import ControlClient
from omni_plugins_mooncake.te.transfer import DONE, Reader
from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment
from tqdm import tqdm

from omni_plugins import wire

MIB = 1 << 20
SIZES = [1 * MIB, 16 * MIB, 64 * MIB]
TARGET = 0.8  # connector put+get >= 0.8x the raw calls
# like with like: the raw calls that move the same bytes once (the other ratios are reported, not targets)
TARGET_RATIOS = ("store_vs_raw_put_from_get_into", "te_vs_raw_read")
BASELINES = {
    "store_raw": "MooncakeDistributedStore put_from (preferred segment = putter) + get_into, registered buffers",
    "store_raw_remove": "the forced remove a consuming reader of store_raw would also need (untimed in store_raw)",
    "te_raw_read": "one TransferEngine.transfer_sync_read of the same bytes (the target baseline for te)",
    "te_raw_async_read": "the same raw read via batch_transfer_async_read + sleeping poll (how the connector waits)",
    "te_raw_write": "one TransferEngine.transfer_sync_write of the same bytes",
}


def _iters(size: int, quick: bool) -> tuple[int, int]:
    """(warmup, timed) iterations for a payload size.

    Quick mode: 150 / 24 / 8 timed rounds at 1 / 16 / 64 MiB (about 45 s): with
    fewer, two 1 MiB medians minutes apart can differ by more than the gaps being
    measured.
    """
    budget = (384 * MIB) if quick else (2048 * MIB)
    timed = int(max(8 if quick else 12, min(150 if quick else 200, budget // size)))
    return 2, timed


class _Buffer:
    """A page-aligned, pre-touched buffer (what a raw Mooncake user would register)."""

    def __init__(self, size: int, fill: int = 0) -> None:
        self.mm = mmap.mmap(-1, size)
        self.mm.write(bytes([fill]) * size) if fill else self.mm.write(b"\x01" * size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.size = size


@contextlib.contextmanager
def _master(address: str | None) -> Iterator[str]:
    if address:
        yield address
        return
    # a long lease: on a busy machine a 64 MiB read can outlive the tests' 500 ms lease (-707)
    with MooncakeMaster(lease_ttl_ms=10_000) as m:
        yield m.address


def _store_client(master: str, segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * MIB, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"store setup failed: {rc}")
    return s


def _engine() -> Any:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("TransferEngine initialise failed")
    return te


class _Echo:
    """A loopback TCP peer whose thread echoes what it receives: the bare round trip, nothing parsed."""

    def __init__(self) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(listener.getsockname()[:2])
        self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server, _ = listener.accept()
        self._server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.close()
        self._thread = threading.Thread(target=self._run, name="bench-echo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._server:
            while data := self._server.recv(64):
                self._server.sendall(data)

    def rtt(self) -> float:
        t0 = time.perf_counter()
        self.client.sendall(b"where-is-key-K??")
        got = self.client.recv(64)
        dt = time.perf_counter() - t0
        if len(got) != 16:
            raise RuntimeError(f"echo returned {len(got)} bytes")
        return dt

    def close(self) -> None:
        self.client.close()
        self._thread.join(5)


class Bench:
    def __init__(self, master: str, max_size: int, segment: int) -> None:
        from omni_plugins import create_connector

        self.master = master
        # raw store: producer with a segment, consumer without (as in the connector runs)
        from mooncake.store import ReplicateConfig

        self.raw_prod = _store_client(master, segment)
        self.raw_cons = _store_client(master, 0)
        # best raw usage, as the connector does: keep the object in the putter's own segment
        self.raw_replicate = ReplicateConfig()
        self.raw_replicate.preferred_segment = self.raw_prod.get_hostname()
        self.src = _Buffer(max_size + MIB, fill=7)
        self.dst = _Buffer(max_size + MIB)
        assert self.raw_prod.register_buffer(self.src.addr, self.src.size) == 0
        assert self.raw_cons.register_buffer(self.dst.addr, self.dst.size) == 0
        # raw TE
        self.te_a, self.te_b = _engine(), _engine()
        self.te_src = _Buffer(max_size + MIB, fill=7)
        self.te_dst = _Buffer(max_size + MIB)
        assert self.te_a.register_memory(self.te_src.addr, self.te_src.size) == 0
        assert self.te_b.register_memory(self.te_dst.addr, self.te_dst.size) == 0
        self.te_peer_a = f"127.0.0.1:{self.te_a.get_rpc_port()}"
        self.te_peer_b = f"127.0.0.1:{self.te_b.get_rpc_port()}"
        self.te_reader = Reader(self.te_b)
        # connectors
        store_cfg = {"master_address": master, "global_segment_size": segment, "local_buffer_size": 16 * MIB}
        self.store_prod = create_connector("mooncake-store", store_cfg)
        self.store_cons = create_connector("mooncake-store", {**store_cfg, "global_segment_size": 0})
        self.te_prod = create_connector("mooncake-te", {"pool_size": 4 * (max_size + MIB)})
        self.te_cons = create_connector("mooncake-te", {"listen_address": None, "peers": [self.te_prod.address]})  # type: ignore[attr-defined]
        # floor parts: a registered slab reused for the staging copy, and a control client of its own
        self.stage = _Buffer(max_size + MIB)
        assert self.te_a.register_memory(self.stage.addr, self.stage.size) == 0
        self.stage_view = memoryview(self.stage.mm)
        self.te_control = ControlClient(self.te_prod.address, timeout=5.0)  # type: ignore[attr-defined]
        self.echo = _Echo()
        self.decode_src = _Buffer(max_size + MIB)
        self.decode_view = memoryview(self.decode_src.mm)
        self.decode_n = 0

    def close(self) -> None:
        self.te_control.close()
        self.echo.close()
        self.decode_view.release()
        self.stage_view.release()
        for conn in (self.store_prod, self.store_cons, self.te_prod, self.te_cons):
            conn.close()
        self.raw_prod.unregister_buffer(self.src.addr)
        self.raw_cons.unregister_buffer(self.dst.addr)
        self.raw_prod.close()
        self.raw_cons.close()

    # -- one timed round per variant ----------------------------------------------
    def store_raw(self, size: int) -> tuple[float, float, float, float]:
        """(put_from + get_into, the forced remove a consuming reader also needs, put_from, get_into)."""
        key = f"raw-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        rc = self.raw_prod.put_from(key, self.src.addr, size, self.raw_replicate)
        t_put = time.perf_counter()
        got = self.raw_cons.get_into(key, self.dst.addr, self.dst.size)
        t1 = time.perf_counter()
        if rc != 0 or got != size:
            raise RuntimeError(f"raw store round failed: put {rc}, get {got}")
        self.raw_cons.remove(key, True)
        return t1 - t0, time.perf_counter() - t1, t_put - t0, t1 - t_put

    def store(self, payload: dict[str, torch.Tensor]) -> tuple[float, float]:
        key = f"conn-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        self.store_prod.put(0, 1, key, payload)
        t1 = time.perf_counter()
        got = self.store_cons.get(0, 1, key)
        t2 = time.perf_counter()
        if got is None:
            raise RuntimeError("store connector lost a payload")
        del got
        return t1 - t0, t2 - t1

    def te_raw_read(self, size: int) -> float:
        t0 = time.perf_counter()
        rc = self.te_b.transfer_sync_read(self.te_peer_a, self.te_dst.addr, self.te_src.addr, size)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"raw TE read failed: {rc}")
        return dt

    def te_raw_async_read(self, size: int) -> float:
        t0 = time.perf_counter()
        rc = self.te_reader.read(self.te_peer_a, self.te_dst.addr, self.te_src.addr, size, time.monotonic() + 60)
        dt = time.perf_counter() - t0
        if rc != DONE:
            raise RuntimeError(f"raw TE async read failed: {rc}")
        return dt

    def te_raw_write(self, size: int) -> float:
        t0 = time.perf_counter()
        rc = self.te_a.transfer_sync_write(self.te_peer_b, self.te_src.addr, self.te_dst.addr, size)
        dt = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"raw TE write failed: {rc}")
        return dt

    def stage_copy(self, payload: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        encoded = wire.encode(payload)
        encoded.write_into(self.stage_view[: encoded.nbytes])
        return time.perf_counter() - t0

    def prepare(self, payload: dict[str, torch.Tensor]) -> None:
        """Lay the encoded payload in ``decode_src`` for the ``decode`` floor part (untimed)."""
        encoded = wire.encode(payload)
        self.decode_n = encoded.nbytes
        encoded.write_into(self.decode_view[: self.decode_n])

    def decode(self) -> float:
        t0 = time.perf_counter()
        obj = wire.decode(self.decode_view[: self.decode_n])
        dt = time.perf_counter() - t0
        del obj
        return dt

    def control_rtt(self) -> float:
        t0 = time.perf_counter()
        claim = self.te_control.claim("bench-absent-key")  # the connector's own "where is K" request, answered "nowhere"
        dt = time.perf_counter() - t0
        if claim is not None:
            raise RuntimeError("the control round trip found a key it should not")
        return dt

    def te(self, payload: dict[str, torch.Tensor]) -> tuple[float, float]:
        key = f"te-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        self.te_prod.put(0, 1, key, payload)
        t1 = time.perf_counter()
        got = self.te_cons.get(0, 1, key)
        t2 = time.perf_counter()
        if got is None:
            raise RuntimeError("te connector lost a payload")
        del got
        return t1 - t0, t2 - t1


def _one_round(bench: Bench, size: int, payload: dict[str, torch.Tensor], rng: random.Random) -> dict[str, float]:
    """Every variant once, in a shuffled order (no variant always runs first, after gc, or last)."""
    variants: list[tuple[tuple[str, ...], Callable[[], Any]]] = [
        (("store_raw", "store_raw_remove", "store_raw_put", "store_raw_get"), partial(bench.store_raw, size)),
        (("store_put", "store_get"), partial(bench.store, payload)),
        (("te_raw_read",), partial(bench.te_raw_read, size)),
        (("te_raw_async_read",), partial(bench.te_raw_async_read, size)),
        (("te_raw_write",), partial(bench.te_raw_write, size)),
        (("te_put", "te_get"), partial(bench.te, payload)),
        (("stage_copy",), partial(bench.stage_copy, payload)),
        (("control_rtt",), bench.control_rtt),
        (("bare_rtt",), bench.echo.rtt),
        (("decode",), bench.decode),
    ]
    rng.shuffle(variants)
    got: dict[str, float] = {}
    for names, run_variant in variants:
        result = run_variant()
        got.update(zip(names, result if isinstance(result, tuple) else (result,), strict=True))
    return got


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    loopback_environment()
    sizes = SIZES
    rounds = {s: _iters(s, args.quick) for s in sizes}
    total = sum(w + n for w, n in rounds.values())
    results: list[dict[str, Any]] = []
    rng = random.Random(0)
    with _master(args.master) as master:
        bench = Bench(master, max(sizes), segment=args.segment_mib * MIB)
        try:
            with tqdm(total=total, desc="mooncake", unit="round") as bar:
                for size in sizes:
                    payload = {"x": torch.randint(0, 256, (size,), dtype=torch.uint8)}
                    bench.prepare(payload)
                    warm, n = rounds[size]
                    samples: dict[str, list[float]] = {
                        k: []
                        for k in (
                            "store_raw",
                            "store_raw_remove",
                            "store_raw_put",
                            "store_raw_get",
                            "store_put",
                            "store_get",
                            "te_raw_read",
                            "te_raw_async_read",
                            "te_raw_write",
                            "te_put",
                            "te_get",
                            "stage_copy",
                            "control_rtt",
                            "bare_rtt",
                            "decode",
                        )
                    }
                    for i in range(warm + n):
                        bar.set_postfix(size=f"{size // MIB}MiB")
                        gc.collect()
                        got = _one_round(bench, size, payload, rng)
                        if i >= warm:
                            for k in samples:
                                samples[k].append(got[k])
                        bar.update(1)
                    med = {k: _median(v) for k, v in samples.items()}
                    store_conn = med["store_put"] + med["store_get"]
                    te_conn = med["te_put"] + med["te_get"]
                    best_read = min(med["te_raw_read"], med["te_raw_async_read"])
                    results.append(
                        {
                            "size_bytes": size,
                            "iterations": n,
                            "median_s": med,
                            "gbps": {
                                "store_raw": size / med["store_raw"] / 1e9,
                                "store": size / store_conn / 1e9,
                                "te_raw_read": size / med["te_raw_read"] / 1e9,
                                "te_raw_async_read": size / med["te_raw_async_read"] / 1e9,
                                "te_raw_write": size / med["te_raw_write"] / 1e9,
                                "te": size / te_conn / 1e9,
                            },
                            "ratio": {
                                "store_vs_raw_put_from_get_into": med["store_raw"] / store_conn,
                                "store_vs_raw_with_remove": (med["store_raw"] + med["store_raw_remove"]) / store_conn,
                                "te_vs_raw_read": med["te_raw_read"] / te_conn,
                                "te_vs_raw_async_read": med["te_raw_async_read"] / te_conn,
                                "te_vs_raw_write_plus_read": (med["te_raw_read"] + med["te_raw_write"]) / te_conn,
                                "te_get_vs_raw_read": med["te_raw_read"] / med["te_get"],
                                # the best any staging connector could do in this run (see the docstring)
                                "store_floor_with_staging_copy": med["store_raw"] / (med["store_raw"] + med["stage_copy"]),
                                "te_floor_vs_raw_read": med["te_raw_read"] / (best_read + med["stage_copy"] + med["control_rtt"]),
                                "te_floor_vs_raw_async_read": med["te_raw_async_read"]
                                / (best_read + med["stage_copy"] + med["control_rtt"]),
                                "te_floor_min_vs_raw_read": med["te_raw_read"] / (best_read + med["stage_copy"] + med["bare_rtt"]),
                                "te_floor_copy_only_vs_raw_read": med["te_raw_read"] / (best_read + med["stage_copy"]),
                                "te_floor_all_vs_raw_read": med["te_raw_read"]
                                / (best_read + med["stage_copy"] + med["bare_rtt"] + med["decode"]),
                                "store_floor_all": med["store_raw"] / (med["store_raw"] + med["stage_copy"] + med["decode"]),
                            },
                        }
                    )
                    results[-1]["target_met"] = {k: results[-1]["ratio"][k] >= TARGET for k in TARGET_RATIOS}
        finally:
            bench.close()
    return {
        "benchmark": "bench_mooncake",
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "definition": "ratio = raw median time / connector median time (put+get); >= 0.8 is the target",
        "target_ratios": list(TARGET_RATIOS),
        "baselines": BASELINES,
        "results": results,
    }


def _plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['size_bytes'] // MIB} MiB" for r in rows]
    keys = ["store_vs_raw_put_from_get_into", "te_vs_raw_read", "te_vs_raw_async_read", "te_vs_raw_write_plus_read"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(keys)
    for i, k in enumerate(keys):
        ax.bar([x + i * width for x in range(len(rows))], [r["ratio"][k] for r in rows], width, label=k)
    ax.axhline(0.8, color="red", linestyle="--", linewidth=1, label="target 0.8")
    ax.set_xticks([x + width for x in range(len(rows))], labels)
    ax.set_ylabel("raw time / connector time")
    ax.set_title("Mooncake connectors vs raw Mooncake (loopback TCP)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--json", metavar="FILE", help="write the report here")
    parser.add_argument("--plot", metavar="FILE.png", help="bar chart of the ratios")
    parser.add_argument("--master", metavar="HOST:PORT", help="use a running mooncake_master instead of starting one")
    parser.add_argument("--segment-mib", type=int, default=512, help="producer global segment size")
    args = parser.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.plot:
        _plot(report, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
