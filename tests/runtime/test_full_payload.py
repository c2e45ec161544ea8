"""Full-payload mode: accumulate, flush, send, receive, publish."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import rt_builders
import torch
from rt_helpers import Req, collect_until, make_runtime, wait_until

PRODUCER = {"custom_process_next_stage_input_func": "rt_builders.whole", "model_stage": "thinker"}


def test_accumulate_flush_send_receive_publish(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **PRODUCER)
    c = make_runtime(1, namespace)
    runtimes += [p, c]
    req = Req("int-a", "ext-a")
    c.register_chunk_recv(Req("c-a", "ext-a"))
    for step in range(4):
        assert p.accumulate_full_payload_output("int-a", {"hidden": torch.full((1, 2), float(step)), "step": step}, req)
    assert p.flush_full_payload_outputs({"int-a", "unknown"}) == ["int-a"]
    assert p.flush_full_payload_outputs({"int-a"}) == []  # already flushed
    got = wait_until(c.recv_full_payload_inputs)
    assert list(got) == ["c-a"]
    hidden = got["c-a"]["hidden"]
    assert hidden["hidden"][:, 0].tolist() == [0, 1, 2, 3] and hidden["step"] == 3
    sig = c.collect_signals()
    assert sig.stage_recv == {"c-a"}
    assert sig.request_metadata == {"c-a": {"next_stage_prompt_len": 7}}  # read from the unwrapped engine_inputs
    assert c.recv_full_payload_inputs() == {}
    assert not c.register_chunk_recv(Req("c-a", "ext-a"))  # payload already arrived


def test_engine_inputs_unwrapped_and_metadata_recorded(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace)  # no builder: raw outputs are sent as they are
    c = make_runtime(1, namespace)
    runtimes += [p, c]
    c.register_chunk_recv(Req("r"))
    assert p.send_full_payload_outputs({"r": ({"engine_inputs": {"meta": {"next_stage_prompt_len": 5}, "x": [1]}}, Req("r"))}) == ["r"]
    got = wait_until(c.recv_full_payload_inputs)
    assert got["r"] == {"meta": {"next_stage_prompt_len": 5}, "x": [1]}
    sig = c.collect_signals()
    assert sig.stage_recv == {"r"} and sig.request_metadata == {"r": {"next_stage_prompt_len": 5}}
    assert c.get_local_stage_payload("r")["x"] == [1]


def test_receive_thread_unregisters_on_arrival(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace)
    c = make_runtime(1, namespace)
    runtimes += [p, c]
    c.register_chunk_recv(Req("r"))
    assert c.debug_state()["receiving"] == ["r"]
    p.send_full_payload_outputs({"r": {"x": [1]}})
    wait_until(lambda: c.debug_state()["requests"]["r"]["has_cached"])
    assert c.debug_state()["receiving"] == []  # before the model thread published it: no more polling
    assert c.recv_full_payload_inputs() == {"r": {"x": [1]}}


def test_full_payload_builder_is_told_the_request_finished(runtimes: list, namespace: str) -> None:
    rt_builders.CALLS.clear()
    p = make_runtime(0, namespace, custom_process_next_stage_input_func="rt_builders.stream", model_stage="thinker")
    runtimes.append(p)
    done = Req("d")
    done.done = True
    assert p.send_full_payload_outputs({"d": ({"x": [1]}, done), "n": ({"x": [2]}, SimpleNamespace(request_id="n"))}) == ["d", "n"]
    # a request that says it finished, and one that cannot say (a flushed request is finished)
    assert rt_builders.CALLS == [{"request": "d", "is_finished": True}, {"request": "n", "is_finished": True}]
    assert p.wait_sends()
    keys = p.connector.keys()
    for key in keys:
        p.connector.cleanup(key)


def test_builder_none_skips_request(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **PRODUCER)
    runtimes.append(p)
    skip = Req("s", skip=True)
    assert p.send_full_payload_outputs({"s": ({"h": 1}, skip), "k": ({"h": 2}, Req("k"))}) == ["k"]
    p.wait_sends()
    assert p.connector.keys() == ["k_0_0"]


def test_replace_keys_come_from_the_builder_module(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **PRODUCER)
    c = make_runtime(1, namespace)
    runtimes += [p, c]
    c.register_chunk_recv(Req("r"))
    for i in range(3):
        p.accumulate_full_payload_output("r", {"model_outputs": torch.full((i + 1, 2), float(i)), "h": torch.ones(1, 2)}, Req("r"))
    p.flush_full_payload_outputs(["r"])
    got = wait_until(c.recv_full_payload_inputs)["r"]["hidden"]
    assert got["model_outputs"].shape == (3, 2) and got["model_outputs"][0, 0] == 2  # replaced
    assert got["h"].shape == (3, 2)  # concatenated


def test_non_data_rank_reports_sent_without_enqueueing(runtimes: list, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    p = make_runtime(0, namespace, tp_size=2, **PRODUCER)
    runtimes.append(p)
    assert not p.is_data_transfer_rank()
    assert p.send_full_payload_outputs({"a": {"x": 1}, "b": {"x": 2}}) == ["a", "b"]
    assert p.send_chunk(Req("a"), {"x": 1}) is True
    p.wait_sends()
    assert p.connector.keys() == []


def test_recv_is_cheap_noop_when_nothing_arrived(runtimes: list, namespace: str) -> None:
    c = make_runtime(1, namespace)
    runtimes.append(c)
    c.register_chunk_recv(Req("r"))
    for _ in range(100):
        assert c.recv_full_payload_inputs() == {}


def test_flush_during_cleanup_sends_the_accumulated_payload(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **PRODUCER)
    c = make_runtime(1, namespace)
    runtimes += [p, c]
    c.register_chunk_recv(Req("r"))
    p.accumulate_full_payload_output("r", {"h": torch.ones(2, 2)}, Req("r"))
    assert p.cleanup_finished_request("r")
    got = wait_until(c.recv_full_payload_inputs)
    assert got["r"]["hidden"]["h"].shape == (2, 2)
    wait_until(lambda: p.active_request_count() == 0)
    seen = collect_until(c, lambda s: bool(s.stage_recv))
    assert seen[-1].stage_recv == {"r"}
