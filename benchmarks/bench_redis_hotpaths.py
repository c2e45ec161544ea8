"""Benchmark: each hand-written piece of the Redis connector against redis-py doing the same job, same run.

The connector's connections, pools, TLS, authentication, Sentinel and cluster
routing are redis-py's; it adds only what these pairs measure (client CPU time
per operation, medians of rounds; ``ratios`` are redis-py / connector, higher
means the connector's piece costs less):

- ``framing_small_put``: a small put's commit transaction, framed from a
  template vs redis-py's ``Connection.pack_commands``;
- ``framing_64MiB_put``: a 64 MiB payload's 32 part ``SET`` s, framed by
  ``packing.pack_many`` (a part spanning two buffers stays two buffers) vs
  ``pack_commands`` (that part must be joined first: a copy);
- ``replies_small_put`` / ``replies_claim``: the replies of a put (deferred
  delete + ``MULTI`` ... ``EXEC``) and of a get's claim (deferred delete +
  ``LMOVE`` + ``PEXPIRE``) by the connector's reader vs ``read_response``;
- ``parts_64MiB_get``: 32 parts of 2 MiB read straight into the payload buffer
  vs ``read_response`` and a copy into it (a real server);
- ``kernel_timeouts``: a ``GET`` round trip on a socket whose timeouts the
  kernel keeps vs Python's (``poll()`` before each send and receive);
- ``kept_connection``: a ``GET`` round trip on a kept connection vs
  ``get_connection`` + ``release`` of redis-py's pool around it.

    python benchmarks/bench_redis_hotpaths.py --json benchmarks/results/redis-hotpaths.json
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import torch
from omni_plugins_redis.config import RedisConfig
from omni_plugins_redis.connection import OmniConnection
from omni_plugins_redis.connector import RedisConnector, _split
from omni_plugins_redis.packing import Pieces, pack_many
from omni_plugins_redis.replies import ReplyReader
from omni_plugins_redis.testing import RedisServer
from redis.connection import Connection

from omni_plugins import wire
from omni_plugins.bench.runner import script_document
from omni_plugins.bench.schema import Column, Section
from omni_plugins.wire import empty_bytes

CHUNK = 2 << 20


def cpu_us(fn: Callable[[], object], n: int, rounds: int) -> float:
    """Median over ``rounds`` of the client CPU time of one call, in microseconds."""
    fn()
    samples = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(n):
            fn()
        samples.append((time.thread_time() - start) / n * 1e6)
    return statistics.median(samples)


def pair_us(name: str, redis_py: Callable[[], object], connector: Callable[[], object], n: int, rounds: int) -> dict[str, float]:
    """Both sides of one pair, their rounds interleaved (a load swing on a shared machine hits both alike)."""
    redis_py()
    connector()
    samples: dict[str, list[float]] = {f"{name}.redis_py": [], f"{name}.connector": []}
    for _ in range(rounds):
        for side, fn in ((f"{name}.redis_py", redis_py), (f"{name}.connector", connector)):
            start = time.thread_time()
            for _ in range(n):
                fn()
            samples[side].append((time.thread_time() - start) / n * 1e6)
    return {side: statistics.median(values) for side, values in samples.items()}


def framing(rounds: int) -> dict[str, float]:
    conn = Connection(protocol=2)
    key, marker, element = b"t:{k}:m", b"t:{k}:w:0123456789abcdef", bytes(4136)
    commit = [("MULTI",), ("RPUSH", key, element), ("PEXPIRE", key, 300_000), ("SET", marker, b"1", "PX", 600_000), ("EXEC",)]
    connector = RedisConnector(RedisConfig())
    try:
        out = pair_us(
            "framing_small_put", lambda: conn.pack_commands(commit), lambda: connector._inline_commit(key, marker, element), 20_000, rounds
        )
    finally:
        connector.close()
    parts = _split(wire.encode({"x": torch.empty(64 << 20, dtype=torch.uint8)}).buffers(), CHUNK)
    names = [b"t:{k}:p:0123456789abcdef:%d" % i for i in range(len(parts))]
    out |= pair_us(
        "framing_64MiB_put",
        lambda: conn.pack_commands(
            [("SET", k, p[0] if len(p) == 1 else memoryview(b"".join(p)), "PX", 360_000) for k, p in zip(names, parts, strict=True)]
        ),
        lambda: pack_many([("SET", k, Pieces(p), "PX", 360_000) for k, p in zip(names, parts, strict=True)]),
        100,
        rounds,
    )
    return out


def replies(rounds: int) -> dict[str, float]:
    """Parse reply batches a feeder thread writes into a socket pair (no server: the parsing alone)."""
    commit = b":1\r\n+OK\r\n+QUEUED\r\n+QUEUED\r\n+QUEUED\r\n*3\r\n:1\r\n:1\r\n+OK\r\n"
    claim = b":1\r\n$4136\r\n" + bytes(4136) + b"\r\n:1\r\n"
    committed = re.compile(rb"\+OK\r\n" + rb"\+QUEUED\r\n" * 3 + rb"\*3\r\n:\d+\r\n:1\r\n\+OK\r\n")
    out: dict[str, float] = {}
    n = 10_000
    for name, payload, parse in (
        ("replies_small_put.redis_py", commit, "py6"),
        ("replies_small_put.connector", commit, "put"),
        ("replies_claim.redis_py", claim, "py3"),
        ("replies_claim.connector", claim, "claim"),
    ):
        a, b = socket.socketpair()
        with a, b:
            conn = Connection(protocol=2)
            conn._sock = b
            conn._parser.on_connect(conn)
            reader = ReplyReader(b, b.settimeout, 30.0)

            def one(parse: str = parse, conn: Connection = conn, reader: ReplyReader = reader) -> None:
                if parse.startswith("py"):
                    for _ in range(int(parse[2:])):
                        conn.read_response()
                elif parse == "put":
                    if not reader.skip_integers(1):
                        reader.reply()
                    if reader.match(committed) is None:
                        for _ in range(5):
                            reader.reply()
                else:
                    if not reader.skip_integers(1):
                        reader.reply()
                    reader.bulk_and_integer()

            total = n * rounds + 1  # what cpu_us reads: one warm-up call, then n per round
            feeder = threading.Thread(target=lambda payload=payload, a=a, total=total: [a.sendall(payload) for _ in range(total)])
            feeder.start()
            out[name] = cpu_us(one, n, rounds)
            feeder.join()
    return out


def with_server(rounds: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with RedisServer() as server:
        admin = server.client()
        names = [f"part{i}" for i in range(32)]
        for name in names:
            admin.set(name, os.urandom(CHUNK))
        admin.set("k", b"v")
        admin.close()
        buffer = empty_bytes(32 * CHUNK)
        whole = memoryview(buffer.data)
        conn = OmniConnection(port=server.port, protocol=2, driver_info=None)
        conn.connect()

        def parts(straight: bool) -> None:
            reader = conn.reader()
            for i in range(0, 32, 2):
                conn.send_packed_command(pack_many([("GET", names[i]), ("GET", names[i + 1])]), check_health=False)
                for j in (i, i + 1):
                    if straight:
                        reader.bulk_size()
                        reader.body_into(whole[j * CHUNK : (j + 1) * CHUNK])
                    else:
                        whole[j * CHUNK : (j + 1) * CHUNK] = conn.read_response()

        out |= pair_us("parts_64MiB_get", lambda: parts(False), lambda: parts(True), 3, rounds)
        conn.disconnect()

        frame = [b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"]
        kernel = OmniConnection(port=server.port, protocol=2, driver_info=None, socket_timeout=30)
        python = Connection(port=server.port, protocol=2, driver_info=None, socket_timeout=30)
        kernel.connect()
        python.connect()
        python_reader = ReplyReader(python._sock, python._sock.settimeout, 30.0)

        def round_trip(c: Any, reader: ReplyReader) -> None:
            c.send_packed_command(frame, check_health=False)
            reader.reply()

        out |= pair_us(
            "kernel_timeouts", lambda: round_trip(python, python_reader), lambda: round_trip(kernel, kernel.reader()), 5000, rounds
        )
        pool = redis.BlockingConnectionPool(port=server.port, protocol=2, driver_info=None, connection_class=OmniConnection)
        kept = [pool.get_connection()]

        def via_pool() -> None:
            c = pool.get_connection()
            round_trip(c, c.reader())
            pool.release(c)

        def via_kept() -> None:
            c = kept.pop()
            round_trip(c, c.reader())
            kept.append(c)

        out |= pair_us("kept_connection", via_pool, via_kept, 5000, rounds)
        for c in (kernel, python, *kept):
            c.disconnect()
        pool.disconnect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", dest="json_path", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    measured = {**framing(args.rounds), **replies(args.rounds), **with_server(args.rounds)}
    pairs = sorted({name.split(".")[0] for name in measured})
    rows = [
        {
            "pair": p,
            "redis_py_us": measured[f"{p}.redis_py"],
            "connector_us": measured[f"{p}.connector"],
            "ratio": measured[f"{p}.redis_py"] / measured[f"{p}.connector"],
        }
        for p in pairs
    ]
    for row in rows:
        print(f"{row['pair']:22s} redis-py {row['redis_py_us']:9.2f} us   connector {row['connector_us']:9.2f} us")
    if args.json_path:
        doc = script_document(quick=False)
        doc.sections["redis_hotpaths"] = Section(
            title="Redis: the connector's hand-written pieces against redis-py",
            about=__doc__.split("\n\n")[1].replace("\n", " ") + f" {args.rounds} rounds.",
            columns=[
                Column(key="pair", label="piece", kind="text"),
                Column(key="redis_py_us", label="redis-py client CPU us"),
                Column(key="connector_us", label="connector client CPU us"),
                Column(key="ratio", label="redis-py / connector"),
            ],
            rows=rows,
        )
        doc.machine.load_avg_end = [round(x, 2) for x in os.getloadavg()]
        doc.write(args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
