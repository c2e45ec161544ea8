"""Runtimes built from a pipeline's graph: fan-out, fan-in, a connector per edge, per-edge builders, KV on its own connector.

Every stage is a runtime in this process over in-process memory connectors
(one namespace per connector instance, unique per test); the cross-process
versions over real backends are in ``test_topology_processes.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
from rt_helpers import FAST, Req, collect_until, wait_until

from omni_plugins.config import parse_pipeline_config
from omni_plugins.memory import MemoryConfig, MemoryConnector
from omni_plugins.runtime import StageTransferRuntime

PASS = "omni_plugins.testing.builders.passthrough"


def ids_only(transfer_manager: Any, pooling_output: Any, request: Any, is_finished: bool = False) -> dict[str, Any]:
    """Per-edge builder: the detokenizer needs only the token ids."""
    return {"ids": {"output": pooling_output["ids"]["output"]}, "meta": {"finished": is_finished}}


def per_destination(transfer_manager: Any, pooling_output: Any, request: Any, to_stage: int, is_finished: bool = False) -> dict[str, Any]:
    """A builder told the destination: called once per output edge."""
    return {"embed": {"decode": pooling_output["embed"]["decode"] * to_stage}, "meta": {"finished": is_finished}}


@pytest.fixture
def ns() -> str:
    return uuid.uuid4().hex[:8]


def _pipeline(text: str, ns: str):  # type: ignore[no-untyped-def]
    return parse_pipeline_config(text.replace("NS", ns), filename="p.yaml")


def _rt(cfg: Any, stage: int, runtimes: list) -> StageTransferRuntime:
    rt = StageTransferRuntime.from_pipeline(cfg, stage, tuning=FAST)
    runtimes.append(rt)
    return rt


def _stored(namespace: str) -> list[str]:
    probe = MemoryConnector(MemoryConfig(namespace=namespace))
    try:
        return probe.keys()
    finally:
        probe.close()


FAN_OUT = f"""
connectors:
  net: {{name: memory, extra: {{namespace: net-NS}}}}
  local: {{name: memory, extra: {{namespace: local-NS}}}}
stages:
  - stage_id: 0
    async_chunk: true
    custom_process_next_stage_input_func: {PASS}
    output_connectors:
      to_stage_1: net
      to_stage_2: {{connector: local, payload_builder: test_topology.ids_only}}
  - {{stage_id: 1, async_chunk: true, input_connectors: {{from_stage_0: net}}}}
  - {{stage_id: 2, async_chunk: true, input_connectors: {{from_stage_0: local}}}}
"""


def test_fan_out_sends_every_chunk_to_every_destination_each_over_its_connector(runtimes: list, ns: str) -> None:
    cfg = _pipeline(FAN_OUT, ns)
    thinker, talker, detok = (_rt(cfg, s, runtimes) for s in (0, 1, 2))
    assert set(thinker.connectors) == {"net", "local"} and thinker.output_stages == [1, 2]
    for rt in (talker, detok):
        assert rt.register_chunk_recv(Req("r"))
    req = Req("r")
    for step in range(3):
        req.done = step == 2
        assert thinker.send_chunk(req, {"embed": {"decode": torch.full((1, 4), float(step))}, "ids": {"output": [step]}})
    for rt in (talker, detok):
        collect_until(rt, lambda sig: "r" in sig.chunk_finished)
    got_talker = talker.get_local_stage_payload("r")
    got_detok = detok.get_local_stage_payload("r")
    assert got_talker["embed"]["decode"][:, 0].tolist() == [0.0, 1.0, 2.0] and got_talker["ids"]["output"] == [0, 1, 2]
    assert "embed" not in got_detok and got_detok["ids"]["output"] == [0, 1, 2]  # its own edge's builder
    assert thinker.debug_state()["requests"]["r"]["sent_per_edge"] == [3, 3]
    for rt in (thinker, talker, detok):
        rt.cleanup_finished_request("r")
        assert rt.active_request_count() == 0
    thinker.wait_sends()
    assert _stored(f"net-{ns}") == [] and _stored(f"local-{ns}") == []
    conns = list(thinker.connectors.values())
    thinker.shutdown()
    assert all(c.closed for c in conns)  # one connector per instance, all closed


def chunk_frames(transfer_manager: Any, pooling_output: Any, request: Any, to_stage: int, is_finished: bool = False) -> dict[str, Any]:
    """Reads its knob as vLLM-Omni's builders do (``transfer_manager.connector.config``) and keeps state on the manager."""
    raw = getattr(transfer_manager.connector, "config", {}) or {}
    cfg = raw.get("extra", raw) if isinstance(raw, dict) else {}
    transfer_manager.builder_calls = getattr(transfer_manager, "builder_calls", 0) + 1
    frames = int(cfg.get("codec_chunk_frames", -1))
    return {"frames": {"n": torch.tensor([frames])}, "meta": {"finished": is_finished}}


BUILDER_SETTINGS = """
connectors:
  net: {name: memory, extra: {namespace: net-NS}, builder_settings: {codec_chunk_frames: 25, codec_left_context_frames: 25}}
  local: {name: memory, extra: {namespace: local-NS}, builder_settings: {codec_chunk_frames: 4}}
  plain: {name: memory, extra: {namespace: plain-NS}}
stages:
  - stage_id: 0
    async_chunk: true
    custom_process_next_stage_input_func: test_topology.chunk_frames
    output_connectors: {to_stage_1: net, to_stage_2: local, to_stage_3: plain}
  - {stage_id: 1, async_chunk: true, input_connectors: {from_stage_0: net}}
  - {stage_id: 2, async_chunk: true, input_connectors: {from_stage_0: local}}
  - {stage_id: 3, async_chunk: true, input_connectors: {from_stage_0: plain}}
"""


def test_builders_read_their_connector_builder_settings(runtimes: list, ns: str) -> None:
    """Each edge's builder sees its connector's builder_settings as ``connector.config``; its state lands on the runtime."""
    cfg = _pipeline(BUILDER_SETTINGS, ns)
    sender, *receivers = (_rt(cfg, s, runtimes) for s in (0, 1, 2, 3))
    for rt in receivers:
        assert rt.register_chunk_recv(Req("r"))
    req = Req("r")
    req.done = True
    assert sender.send_chunk(req, {"x": {"y": torch.zeros(1)}})
    frames = []
    for rt in receivers:
        collect_until(rt, lambda sig: "r" in sig.chunk_finished)
        frames.append(int(rt.get_local_stage_payload("r")["frames"]["n"][0]))
        rt.cleanup_finished_request("r")
    assert frames == [25, 4, -1]  # a connector without builder settings: the builder's default
    assert sender.builder_calls == 3  # set through the view, kept on the runtime
    assert sender.connectors["net"].name == "memory"  # the runtime's own connectors are untouched
    sender.cleanup_finished_request("r")


def test_fan_out_keys_carry_the_destination(runtimes: list, ns: str) -> None:
    cfg = _pipeline(FAN_OUT, ns)
    thinker = _rt(cfg, 0, runtimes)
    thinker.send_chunk(Req("r"), {"embed": {"decode": torch.ones(1, 2)}, "ids": {"output": [1]}})
    thinker.wait_sends()
    assert _stored(f"net-{ns}") == ["r_0-1_0"] and _stored(f"local-{ns}") == ["r_0-2_0"]
    thinker.cleanup_finished_request("r", aborted=True)  # nobody reads them: an abort frees both
    thinker.wait_sends()
    assert _stored(f"net-{ns}") == [] and _stored(f"local-{ns}") == []


def test_a_builder_naming_to_stage_is_called_per_destination(runtimes: list, ns: str) -> None:
    cfg = _pipeline(
        """
connectors: {c: {name: memory, extra: {namespace: c-NS}}}
stages:
  - {stage_id: 0, custom_process_next_stage_input_func: test_topology.per_destination, output_connectors: {to_stage_1: c, to_stage_2: c}}
  - {stage_id: 1, input_connectors: {from_stage_0: c}}
  - {stage_id: 2, input_connectors: {from_stage_0: c}}
""",
        ns,
    )
    src, one, two = (_rt(cfg, s, runtimes) for s in (0, 1, 2))
    for rt in (one, two):
        rt.register_chunk_recv(Req("r"))
    assert src.send_full_payload_outputs({"r": ({"embed": {"decode": torch.ones(1, 2)}}, Req("r"))}) == ["r"]
    got1 = wait_until(lambda: one.recv_full_payload_inputs())
    got2 = wait_until(lambda: two.recv_full_payload_inputs())
    assert got1["r"]["embed"]["decode"].tolist() == [[1.0, 1.0]] and got2["r"]["embed"]["decode"].tolist() == [[2.0, 2.0]]


FAN_IN = """
connectors:
  a: {name: memory, extra: {namespace: a-NS}}
  b: {name: memory, extra: {namespace: b-NS}}
stages:
  - {stage_id: 0, async_chunk: ASYNC, custom_process_next_stage_input_func: PASS, output_connectors: {to_stage_2: a}}
  - {stage_id: 1, async_chunk: ASYNC, custom_process_next_stage_input_func: PASS, output_connectors: {to_stage_2: b}}
  - {stage_id: 2, async_chunk: ASYNC, recv_timeout_s: TIMEOUT, input_connectors: {from_stage_0: a, from_stage_1: b}}
"""


def _fan_in(ns: str, *, stream: bool, timeout: float = 30):  # type: ignore[no-untyped-def]
    text = FAN_IN.replace("ASYNC", str(stream).lower()).replace("PASS", PASS).replace("TIMEOUT", str(timeout))
    return _pipeline(text, ns)


def test_fan_in_full_payload_is_published_once_every_source_delivered(runtimes: list, ns: str) -> None:
    cfg = _fan_in(ns, stream=False)
    text_enc, image_enc, denoiser = (_rt(cfg, s, runtimes) for s in (0, 1, 2))
    assert denoiser.input_stages == [0, 1] and denoiser.fan_in and len(denoiser.debug_state()["receivers"]) == 2
    denoiser.register_chunk_recv(Req("r"))
    text_enc.send_full_payload_outputs({"r": ({"embed": {"decode": torch.zeros(2, 3)}}, Req("r"))})
    wait_until(lambda: denoiser.debug_state()["requests"]["r"]["inputs"][0]["payload_arrived"])
    assert denoiser.recv_full_payload_inputs() == {}  # one source is not a request's input yet
    image_enc.send_full_payload_outputs({"r": ({"embed": {"decode": torch.ones(4, 3)}}, Req("r"))})
    got = wait_until(lambda: denoiser.recv_full_payload_inputs())
    assert set(got["r"]) == {0, 1}
    assert got["r"][0]["embed"]["decode"].shape == (2, 3) and got["r"][1]["embed"]["decode"].shape == (4, 3)
    assert "r" in denoiser.collect_signals().stage_recv
    assert set(denoiser.get_local_stage_payload("r")) == {0, 1}
    denoiser.cleanup_finished_request("r")
    assert denoiser.active_request_count() == 0


def test_fan_in_times_out_naming_the_missing_source_and_frees_what_arrived(runtimes: list, ns: str) -> None:
    cfg = _fan_in(ns, stream=False, timeout=0.5)
    text_enc, _image_enc, denoiser = (_rt(cfg, s, runtimes) for s in (0, 1, 2))
    denoiser.register_chunk_recv(Req("r"))
    text_enc.send_full_payload_outputs({"r": ({"embed": {"decode": torch.zeros(2, 3)}}, Req("r"))})
    seen = collect_until(denoiser, lambda sig: "r" in sig.timed_out, timeout=10)
    assert seen[-1].missing_sources == {"r": [1]}  # stage 0 delivered; stage 1 never did
    assert denoiser.recv_full_payload_inputs() == {}
    assert denoiser.active_request_count() == 0  # the arrived payload went with the request
    assert _stored(f"a-{ns}") == [] and _stored(f"b-{ns}") == []


def test_fan_in_streams_are_kept_per_source_and_finish_when_every_source_did(runtimes: list, ns: str) -> None:
    cfg = _fan_in(ns, stream=True)
    src0, src1, sink = (_rt(cfg, s, runtimes) for s in (0, 1, 2))
    sink.register_chunk_recv(Req("r"))
    r0, r1 = Req("r"), Req("r")
    src0.send_chunk(r0, {"embed": {"decode": torch.zeros(1, 2)}})
    sig = collect_until(sink, lambda s: "r" in s.chunk_ready)[-1]
    assert sig.chunk_ready_sources == {"r": {0}}
    r0.done = True
    src0.send_chunk(r0, {"embed": {"decode": torch.zeros(1, 2)}})
    src1.send_chunk(r1, {"embed": {"decode": torch.ones(1, 2)}})
    finished: set[int] = set()
    ready: set[int] = set()

    def both(sig: Any) -> bool:
        finished.update(sig.chunk_finished_sources.get("r", ()))
        ready.update(sig.chunk_ready_sources.get("r", ()))
        return 0 in finished and 1 in ready

    seen = collect_until(sink, both)
    assert finished == {0} and not any("r" in s.chunk_finished for s in seen)  # source 1 still streams
    payload = sink.get_local_stage_payload("r")
    assert payload[0]["embed"]["decode"].shape == (2, 2) and payload[1]["embed"]["decode"].tolist() == [[1.0, 1.0]]
    r1.done = True
    src1.send_chunk(r1, {"embed": {"decode": torch.ones(1, 2)}})
    woken = wait_until(lambda: sink.recv_chunk())
    assert set(woken["r"]) == {1}  # only the source that woke it
    last = collect_until(sink, lambda s: "r" in s.chunk_finished)[-1]
    assert last.chunk_finished_sources == {"r": {1}}
    sink.cleanup_finished_request("r")
    assert sink.active_request_count() == 0


def test_kv_edge_over_its_own_connector(runtimes: list, ns: str) -> None:
    from omni_plugins.kv.testing import build_paged_caches, full_kv

    cfg = _pipeline(
        """
connectors:
  chunks: {name: memory, extra: {namespace: chunks-NS}}
  kv: {name: memory, extra: {namespace: kv-NS}}
stages:
  - {stage_id: 0, kv_transfer: true, kv_layout: nhd, output_connectors: {to_stage_1: {connector: chunks, kv_connector: kv}}}
  - {stage_id: 1, kv_transfer: true, input_connectors: {from_stage_0: {connector: chunks, kv_connector: kv}}}
""",
        ns,
    )
    prefill, decode = _rt(cfg, 0, runtimes), _rt(cfg, 1, runtimes)
    assert set(prefill.connectors) == {"chunks", "kv"}
    caches, todo = build_paged_caches({"r": full_kv("r", num_layers=2, seq_len=5, num_heads=2, head_dim=4)}, block_size=4)
    assert prefill.send_kv_cache(todo, caches, 4, "float32") == ["r"]
    assert _stored(f"kv-{ns}") == ["r_0_0_0_0"] and _stored(f"chunks-{ns}") == []
    payload, size = decode.recv_kv_cache("r")
    assert payload is not None and size > 0 and len(payload["layer_blocks"]["key_cache"]) == 2
    for rt in (prefill, decode):
        rt.cleanup_finished_request("r")
    assert _stored(f"kv-{ns}") == []
