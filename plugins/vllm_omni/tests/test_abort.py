"""An aborted request's chunks: vLLM-Omni's chunk adapter frees them only for its own shared-memory
connector, so with ``OmniPlugins`` the backend's expiry or ``cleanup(request_id)`` frees them."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash scripts/setup.sh vllm-omni)")

import torch
from omni_plugins_vllm_omni.connector import OmniPluginsConnector
from omni_plugins_vllm_omni.keys import edge_key
from omni_plugins_vllm_omni.testing import wait_for
from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import OmniChunkTransferAdapter
from vo_helpers import backend_extra

from omni_plugins import create_connector

CHUNKS = 3
TTL_S = 1.0


class SenderRequest:
    """The fields of a vLLM ``Request`` the chunk adapter's send path reads."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.external_req_id = request_id
        self.num_computed_tokens = 0
        self.resumable = False
        self.prompt_token_ids: list[int] = []
        self.additional_information = None

    def is_finished(self) -> bool:
        return False


def _adapter(extra: dict[str, Any]) -> OmniChunkTransferAdapter:
    model_config = SimpleNamespace(
        stage_connector_config={"name": "OmniPlugins", "extra": {**extra, "role": "sender"}},
        stage_id=0,
        async_chunk=True,
        worker_type="ar",
        custom_process_next_stage_input_func="omni_plugins_vllm_omni.testing.chunk_payload",
        max_model_len=4096,
    )
    return OmniChunkTransferAdapter(SimpleNamespace(model_config=model_config, scheduler_config=SimpleNamespace(max_num_seqs=4)))


def _stop(adapter: OmniChunkTransferAdapter) -> None:
    adapter.stop_event.set()
    for cond in (adapter._save_cond, adapter._recv_cond):
        with cond:
            cond.notify_all()
    adapter.save_thread.join(10)
    adapter.recv_thread.join(10)
    adapter.connector.close()


def _stream(adapter: OmniChunkTransferAdapter, request: SenderRequest, chunks: int) -> None:
    connector = adapter.connector
    puts = connector.health()["puts"]
    for step in range(chunks):
        request.num_computed_tokens = step + 1
        adapter.save_async({"hidden": torch.full((4, 8), float(step))}, request)
    assert wait_for(lambda: connector.health()["puts"] == puts + chunks, 30.0), connector.health()


def _present(extra: dict[str, Any], request_id: str, chunks: int = CHUNKS) -> list[str]:
    """The backend keys of ``request_id``'s chunks the backend still holds (looked up, not consumed)."""
    keys = [edge_key(f"{request_id}_0_{i}", 0, 1) for i in range(chunks)]
    with create_connector(extra["backend"], extra["backend_config"]) as probe:
        return sorted(probe.wait_any(keys, 0.0))


@pytest.fixture(params=["shm", "redis"])
def backend(request: pytest.FixtureRequest, namespace: str) -> Callable[..., dict[str, Any]]:
    """``OmniPlugins`` extra on the backend, with the given backend settings."""
    if request.param == "shm":
        return lambda **settings: backend_extra("shm", namespace=namespace, **settings)
    redis, prefix = request.getfixturevalue("redis_server"), request.getfixturevalue("redis_prefix")
    return lambda **settings: backend_extra("redis", redis=redis, prefix=prefix, **settings)


def test_an_aborted_requests_chunks_are_freed_by_cleanup(backend: Callable[..., dict[str, Any]]) -> None:
    setup = backend()
    adapter = _adapter(setup)
    try:
        connector = adapter.connector
        assert isinstance(connector, OmniPluginsConnector) and connector.stage_id == 0
        request = SenderRequest("tvo-abort-1")
        _stream(adapter, request, CHUNKS)
        assert len(_present(setup, request.external_req_id)) == CHUNKS
        adapter.cleanup(request.request_id, request.external_req_id)  # the scheduler's abort: vLLM-Omni frees nothing here
        assert len(_present(setup, request.external_req_id)) == CHUNKS
        connector.cleanup(request.external_req_id)  # what the request left, on every edge
        assert _present(setup, request.external_req_id) == []
        assert connector.health()["cleaned"] == CHUNKS and connector.health()["pending"] == 0
    finally:
        _stop(adapter)


def test_an_aborted_requests_chunks_expire_in_the_backend(backend: Callable[..., dict[str, Any]]) -> None:
    setup = backend(ttl_seconds=TTL_S)
    adapter = _adapter(setup)
    try:
        _stream(adapter, SenderRequest("tvo-abort-2"), CHUNKS)
        adapter.cleanup("tvo-abort-2", "tvo-abort-2")  # frees nothing (see the test above); the expiry does
        if setup["backend"] == "shm":
            # the producer frees its expired payloads on a later put (the stage goes on with other requests)
            live = SenderRequest("tvo-live")
            assert wait_for(lambda: (_stream(adapter, live, 1), _present(setup, "tvo-abort-2"))[1] == [], 30.0, pause=TTL_S / 4)
            adapter.connector.cleanup("tvo-live")
        else:
            assert wait_for(lambda: _present(setup, "tvo-abort-2") == [], 30.0)  # Redis expires the keys itself
    finally:
        _stop(adapter)
