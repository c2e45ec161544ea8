"""Helpers for the vLLM-Omni integration tests: a fresh vLLM-Omni stage process, and payloads.

Importing vLLM-Omni costs ~20 s of CPU per process, so the tests use few processes: the test
process itself and one :class:`StageProcess`, a spawned interpreter (nothing inherited) that
starts the way a vLLM-Omni stage process does (``load_omni_general_plugins()``, which runs this
distribution's entry point) and then runs the test's requests (functions of this module) one by one.
Results come back as plain values (:func:`plain`): tensors as ``(dtype, shape, bytes)``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

_START_TIMEOUT_S = 300.0


def plain(obj: Any) -> Any:
    """``obj`` with tensors as ``("tensor", dtype, shape, bytes)`` (safe to send back, nothing shared)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return ("tensor", str(t.dtype), tuple(t.shape), t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


class StageProcess:
    """One spawned vLLM-Omni process serving :meth:`call` requests (context manager; :meth:`close` stops it)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), name="vllm-omni-stage", daemon=True)
        self.process.start()
        child.close()
        self._ready: dict[str, Any] | None = None

    def ready(self) -> dict[str, Any]:
        """What the process saw at start: its pid and vLLM-Omni's registered connectors (waits for its imports)."""
        if self._ready is None:
            if not self._conn.poll(_START_TIMEOUT_S):
                raise TimeoutError(f"vLLM-Omni stage process did not start in {_START_TIMEOUT_S:.0f} s")
            self._ready = self._receive()
        return self._ready

    def call(self, function: str, timeout: float = 120.0, **kwargs: Any) -> Any:
        """Run ``omni_plugins_vllm_omni.testing.<function>(**kwargs)`` in the process; its result (or its error, raised here)."""
        self.ready()
        self._conn.send((function, kwargs))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{function} did not return in {timeout:.0f} s")
        return self._receive()

    def _receive(self) -> Any:
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"in the vLLM-Omni stage process:\n{value}")
        return value

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self._conn.close()

    def __enter__(self) -> StageProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(conn: Any) -> None:
    try:
        conn.send(("ok", registered_connectors()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        request = conn.recv()
        if request is None:
            return
        function, kwargs = request
        try:
            conn.send(("ok", plain(globals()[function](**kwargs))))
        except Exception:
            conn.send(("error", traceback.format_exc()))


# -- what the stage process runs ----------------------------------------------------------------
def registered_connectors() -> dict[str, Any]:
    """Load plugins as a vLLM-Omni process does; this process's pid and the factory's connector names."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.plugins import load_omni_general_plugins

    before = OmniConnectorFactory.list_registered_connectors()
    load_omni_general_plugins()
    return {"pid": os.getpid(), "before": before, "after": OmniConnectorFactory.list_registered_connectors()}


def receive_stage_inputs(config: dict[str, Any], stage_id: int, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stage's receive path: the transfer config through vLLM-Omni's loader and factory, then
    ``try_recv_via_connector`` for each queue message; the inputs, metrics and connector health."""
    from vllm_omni.distributed.omni_connectors.adapter import try_recv_via_connector
    from vllm_omni.distributed.omni_connectors.utils.initialization import create_connectors_from_config, load_omni_transfer_config

    transfer = load_omni_transfer_config(config_dict=config)
    assert transfer is not None
    connectors = create_connectors_from_config(transfer.connectors, caller_stage_id=stage_id)
    try:
        received = [try_recv_via_connector(task, connectors, stage_id) for task in tasks]
        health = {f"{a}->{b}": c.health() for (a, b), c in connectors.items()}
        kinds = {f"{a}->{b}": type(c).__name__ for (a, b), c in connectors.items()}
    finally:
        for connector in connectors.values():
            connector.close()
    return {"received": received, "health": health, "kinds": kinds}


def receive_kv(connector_config: dict[str, Any], from_stage: int, stage_id: int, request_ids: list[str]) -> list[Any]:
    """vLLM-Omni's KV transfer manager on the receiving stage: ``receive_kv_cache_for_request`` per request."""
    from vllm_omni.distributed.omni_connectors.kv_transfer_manager import OmniKVTransferManager

    manager = OmniKVTransferManager._create(
        {
            "connector_config": connector_config,
            "stage_id": stage_id,
            "engine_input_source": [from_stage],
            "need_recv_cache": True,
            "recv_timeout": 60.0,
        }
    )
    try:
        return [manager.receive_kv_cache_for_request(rid) for rid in request_ids]
    finally:
        connector = manager.connector
        if connector is not None:
            connector.close()


# -- payload builder for vLLM-Omni's chunk adapter -----------------------------------------------
def chunk_payload(transfer_manager: Any, multimodal_output: Any, request: Any, is_finished: bool = False) -> Any:
    """A ``custom_process_next_stage_input_func``: the stage output's ``hidden`` tensor as one chunk."""
    from vllm_omni.data_entry_keys import OmniPayloadStruct

    return OmniPayloadStruct(hidden=multimodal_output["hidden"], request_id=request.external_req_id)


def wait_for(condition: Callable[[], bool], timeout: float, pause: float = 0.05) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass (a bound, not a measurement)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
    return True
