"""A producer process and a consumer process move a 64 MiB payload intact, through both connectors."""

from __future__ import annotations

import multiprocessing as mp
import uuid

from omni_plugins_mooncake.testing import MooncakeMaster

from omni_plugins import create_connector

from . import _children
from .conftest import store_config


def test_64mib_payload_between_processes(master: MooncakeMaster) -> None:
    ctx = mp.get_context("spawn")
    ready, report, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    key = f"big-{uuid.uuid4().hex}"
    specs = {"mooncake-store": store_config(master), "mooncake-te": {"pool_size": "256MiB"}}
    child = ctx.Process(target=_children.produce, args=(specs, key, 7, ready, done, report))
    child.start()
    try:
        addresses, expected = ready.get(timeout=180)
        consumers = {
            # the consumer contributes no segment: the bytes stay in the producer's until read
            "mooncake-store": store_config(master, global_segment_size=0),
            "mooncake-te": {"listen_address": None, "peers": [addresses["mooncake-te"]]},
        }
        for name, config in consumers.items():
            with create_connector(name, config) as conn:
                got = conn.get(0, 1, key, timeout=30)
                assert got is not None, name
                assert got.size > _children.BIG and got.data["meta"] == {"seed": 7}
                assert _children.digest(got.data) == expected, f"{name} corrupted the payload"
                del got
                assert conn.get(0, 1, key) is None, f"{name} did not consume"
        done.set()
        health = report.get(timeout=60)
        assert health["mooncake-te"]["staged"] == 0 and health["mooncake-te"]["staging_pool"]["in_use_bytes"] == 0
    finally:
        done.set()
        child.join(60)
    assert child.exitcode == 0
