"""Nothing in the data path imports or uses pickle: wire, runtime, and the shm and Redis connectors
move a stream end to end in a process where pickle cannot be imported or used.

Third-party modules that import pickle themselves at import time (numpy, torch,
msgpack, pydantic, yaml) are imported first; then ``pickle``/``_pickle``/``cPickle``/
``dill``/``cloudpickle`` are replaced by poisoned modules (any attribute access fails)
and a meta-path hook refuses to import them again. Only then are our modules imported.
The runtime is single-rank: the TP broadcast (``torch.distributed``, which pickles) is
the intra-group control path, not the data path. ``tests/wire/test_safety.py`` checks
the wire package alone; this goes through the runtime and both connectors.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from typing import Any

from omni_plugins.testing.nopickle import BLOCK_PICKLE_SOURCE

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys, types

    import msgpack, numpy, torch, yaml, pydantic, pluggy  # noqa: F401  (they import pickle themselves)

    already = sorted(m for m in sys.modules if m.startswith(("omni_plugins",)))
    assert not already, already

    # <block-pickle>

    import omni_plugins.wire  # noqa: F401
    import omni_plugins_redis.connector  # noqa: F401
    import omni_plugins_shm.connector  # noqa: F401
    from omni_plugins.config.models import StageConfig
    from omni_plugins.runtime import RuntimeTuning, StageTransferRuntime
    from types import SimpleNamespace

    def req(rid, done):
        return SimpleNamespace(request_id=rid, external_req_id=rid, is_finished=lambda: done)

    def round_trip(connector):
        tuning = RuntimeTuning(join_timeout_s=3.0, drain_timeout_s=3.0)
        builder = "omni_plugins.testing.builders.passthrough"
        producer = StageTransferRuntime(StageConfig(stage_id=0, async_chunk=True, custom_process_next_stage_input_func=builder), connector, tuning=tuning)
        consumer = StageTransferRuntime(StageConfig(stage_id=1, async_chunk=True, recv_timeout_s=30), connector, tuning=tuning)
        try:
            consumer.register_chunk_recv(req("r1", False))
            for i in range(3):
                out = {"embed": {"decode": torch.full((1, 1000), float(i))}, "ids": {"output": [i]}, "tag": "s" * 10, "b": b"x" * 70000}
                assert producer.send_chunk(req("r1", i == 2), out)
            assert producer.wait_sends(30)
            for _ in range(3000):
                consumer.wait_ready(0.01)
                signals = consumer.collect_signals()
                if "r1" in signals.chunk_finished:
                    break
                assert not signals.failed and not signals.timed_out, signals
            else:
                raise AssertionError("stream did not finish")
            payload = consumer.get_local_stage_payload("r1")
            assert payload["ids"]["output"] == [0, 1, 2], payload["ids"]
            assert torch.equal(payload["embed"]["decode"][:, 0], torch.tensor([0.0, 1.0, 2.0]))
            consumer.cleanup_finished_request("r1")
            producer.cleanup_finished_request("r1")
            assert consumer.active_request_count() == 0 and producer.active_request_count() == 0
        finally:
            producer.shutdown()
            consumer.shutdown()

    round_trip({"name": "shm", "extra": {"namespace": sys.argv[1], "pool_bytes": 8 << 20}})
    round_trip({"name": "redis", "extra": {"url": sys.argv[2], "key_prefix": sys.argv[3]}})

    for name, module in list(sys.modules.items()):
        if name.startswith("omni_plugins"):
            for value in vars(module).values():
                assert not isinstance(value, Poisoned), f"{name} imported {value.__name__}"
                assert getattr(value, "__name__", None) not in BLOCKED or not isinstance(value, types.ModuleType), name
    print("OK")
    """
).replace("# <block-pickle>", BLOCK_PICKLE_SOURCE)


def test_data_path_round_trips_with_pickle_blocked(redis_server: Any) -> None:
    from omni_plugins_shm.testing import assert_namespace_empty, unique_namespace

    namespace, prefix = unique_namespace("nopickle"), f"np-{uuid.uuid4().hex[:6]}:"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, namespace, redis_server.url, prefix], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "OK"
    assert_namespace_empty(namespace)
    assert redis_server.keys(prefix + "*") == []
