"""Streaming mode (async_chunk): send_chunk, per-chunk delivery rules, gating, registration guards."""

from __future__ import annotations

import time

import pytest
import rt_builders
import torch
from rt_helpers import GatedConnector, PollOnlyConnector, Req, collect_until, make_runtime, wait_until

from omni_plugins import create_connector
from omni_plugins.memory import MemoryConfig

STREAM = {"async_chunk": True, "custom_process_next_stage_input_func": "rt_builders.stream"}


def _pair(runtimes: list, namespace: str, worker: str = "ar", **consumer: object):
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, async_chunk=True, worker_type=worker, **consumer)
    runtimes += [p, c]
    return p, c


def test_ar_stream_accumulates_and_finishes(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace)
    req = Req("int-1", "ext-1")
    assert c.register_chunk_recv(Req("int-1c", "ext-1"))
    for step in range(3):
        req.done = step == 2
        assert p.send_chunk(req, {"embed": {"decode": torch.full((2, 3), float(step))}, "ids": {"prompt": [step]}})
    seen = collect_until(c, lambda s: "int-1c" in s.chunk_finished)
    assert {"int-1c"} <= set().union(*(s.chunk_ready for s in seen))
    payload = c.get_local_stage_payload("int-1c")
    assert payload["embed"]["decode"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert payload["ids"]["prompt"] == [0, 1, 2]
    assert payload["meta"]["finished"] is True
    # keys are {external id}_{from stage}_{chunk}: the producer counted 3 chunks for ext-1
    assert p.put_req_chunk["ext-1"] == 3
    # a finished stream is never registered again
    assert not c.register_chunk_recv(Req("int-1c", "ext-1"))
    assert c.debug_state()["receiving"] == []
    # the accumulation buffer was released when the stream finished
    assert "ext-1" not in c.request_payload


def test_chunks_merged_while_nobody_reads_are_joined_for_every_reader(runtimes: list, namespace: str) -> None:
    """The receive thread leaves concatenations pending (PendingCat); every way the runner reads the
    payload -- recv_chunk, request_payload, get/pop_local_stage_payload -- sees the joined tensors."""
    from omni_plugins.runtime.accumulate import PendingCat

    p, c = _pair(runtimes, namespace)
    c.register_chunk_recv(Req("r"))
    req = Req("r")
    for step in range(4):
        p.send_chunk(req, {"embed": {"decode": torch.full((1, 2), float(step))}, "codes": {"audio": torch.full((1, 1), step)}})
    state = c._registry.get("r").inputs[0]
    wait_until(lambda: state.next_recv_chunk == 4)
    with c._lock:
        assert type(state.cached["embed"]["decode"]) is PendingCat  # four chunks, no cat yet
        assert state.cached["codes"]["audio"].shape == (4, 1)  # codes feed the scheduling metadata: merged at once
    rows = [0.0, 1.0, 2.0, 3.0]
    assert c.recv_chunk()["r"]["embed"]["decode"][:, 0].tolist() == rows
    assert c.request_payload["r"]["embed"]["decode"][:, 0].tolist() == rows
    sig = c.collect_signals()
    assert sig.request_metadata["r"]["code_predictor_codes"][:, 0].tolist() == [0, 1, 2, 3]
    p.send_chunk(req, {"embed": {"decode": torch.full((1, 2), 4.0)}})
    wait_until(lambda: state.next_recv_chunk == 5)
    assert c.get_local_stage_payload("r")["embed"]["decode"][:, 0].tolist() == [*rows, 4.0]
    p.send_chunk(req, {"embed": {"decode": torch.full((1, 2), 5.0)}})
    wait_until(lambda: state.next_recv_chunk == 6)
    assert c.pop_local_stage_payload("r")["embed"]["decode"][:, 0].tolist() == [*rows, 4.0, 5.0]


def test_a_payload_read_from_the_cache_is_not_changed_by_later_chunks(runtimes: list, namespace: str) -> None:
    """The runner reads ``get_local_stage_payload`` outside the runtime's lock: a chunk merged after
    the read must not swap the sections of the dict it holds (they would hold unjoined PendingCats)."""
    p, c = _pair(runtimes, namespace)
    c.register_chunk_recv(Req("r"))
    req = Req("r")
    state = c._registry.get("r").inputs[0]
    for step in range(2):
        p.send_chunk(req, {"trace": {"step": torch.tensor([[step]])}, "embed": {"decode": torch.full((1, 2), float(step))}})
    wait_until(lambda: state.next_recv_chunk == 2)
    held = c.get_local_stage_payload("r")
    p.send_chunk(req, {"trace": {"step": torch.tensor([[2]])}, "embed": {"decode": torch.full((1, 2), 2.0)}})
    wait_until(lambda: state.next_recv_chunk == 3)
    assert type(held["trace"]["step"]) is torch.Tensor and held["trace"]["step"][:, 0].tolist() == [0, 1]
    assert type(held["embed"]["decode"]) is torch.Tensor and held["embed"]["decode"][:, 0].tolist() == [0.0, 1.0]
    assert c.get_local_stage_payload("r")["trace"]["step"][:, 0].tolist() == [0, 1, 2]  # the next read has the new chunk


def test_recv_chunk_returns_copies_of_ready_payloads(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace)
    c.register_chunk_recv(Req("r", "r"))
    p.send_chunk(Req("r", "r"), {"embed": {"decode": torch.ones(1, 2)}})
    got = wait_until(c.recv_chunk)
    got["r"]["injected"] = 1
    assert "injected" not in c.get_local_stage_payload("r")
    assert c.recv_chunk().keys() == {"r"}  # not drained by reading
    assert c.collect_signals().chunk_ready == {"r"}
    assert c.recv_chunk() == {}  # drained by collect_signals


def test_recv_chunk_copies_do_not_share_sections_with_the_accumulation(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace)
    c.register_chunk_recv(Req("r"))
    req = Req("r")
    p.send_chunk(req, {"embed": {"decode": torch.zeros(1, 2)}, "ids": {"prompt": [0]}})
    got = wait_until(c.recv_chunk)
    got["r"]["embed"].pop("decode")  # the runner edits its copy
    got["r"]["ids"]["prompt"] = []
    assert c.get_local_stage_payload("r")["embed"]["decode"].shape == (1, 2)
    c.collect_signals()
    p.send_chunk(req, {"embed": {"decode": torch.ones(1, 2)}, "ids": {"prompt": [1]}})
    wait_until(lambda: c.debug_state()["requests"]["r"]["next_recv_chunk"] == 2)
    cached = c.get_local_stage_payload("r")
    assert cached["embed"]["decode"][:, 0].tolist() == [0, 1]  # the accumulation was not touched
    assert cached["ids"]["prompt"] == [0, 1]


def test_metadata_only_chunk_updates_cache_without_waking(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace)
    c.register_chunk_recv(Req("r"))
    req = Req("r")
    p.send_chunk(req, {"meta": {"next_stage_prompt_len": 11}, "embed": {"decode_token_start": 0, "decode_token_end": 4}})
    seen = collect_until(c, lambda s: "r" in s.request_metadata)
    assert all("r" not in s.chunk_ready for s in seen)
    assert seen[-1].request_metadata["r"]["next_stage_prompt_len"] == 11
    assert c.get_local_stage_payload("r")["meta"]["next_stage_prompt_len"] == 11
    # then a consumable chunk wakes it; the cache was merged, not replaced
    p.send_chunk(req, {"embed": {"decode": torch.ones(2, 2), "decode_token_start": 0, "decode_token_end": 2}})
    collect_until(c, lambda s: "r" in s.chunk_ready)
    cached = c.get_local_stage_payload("r")
    assert cached["meta"]["next_stage_prompt_len"] == 11 and cached["embed"]["decode"].shape == (2, 2)


def test_finish_sentinel_without_content_still_wakes(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace)
    c.register_chunk_recv(Req("r"))
    req = Req("r")
    p.send_chunk(req, {"embed": {"decode": torch.ones(1, 2)}})
    collect_until(c, lambda s: "r" in s.chunk_ready)  # the content chunk's wake is drained first
    req.done = True
    p.send_chunk(req, {"meta": {}})
    seen = collect_until(c, lambda s: "r" in s.chunk_finished)
    assert "r" in seen[-1].chunk_ready  # woken by the sentinel itself


def test_span_merge_end_to_end(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace)
    c.register_chunk_recv(Req("r"))
    req = Req("r")
    p.send_chunk(req, {"embed": {"decode": torch.zeros(3, 2), "decode_token_start": 0, "decode_token_end": 3}})
    p.send_chunk(req, {"embed": {"decode": torch.ones(3, 2), "decode_token_start": 2, "decode_token_end": 5}})
    wait_until(lambda: c.debug_state()["requests"]["r"]["next_recv_chunk"] == 2)
    embed = c.get_local_stage_payload("r")["embed"]
    assert embed["decode"][:, 0].tolist() == [0, 0, 1, 1, 1]
    assert (embed["decode_token_start"], embed["decode_token_end"]) == (0, 5)


def test_generation_worker_keeps_one_chunk_in_flight(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace, worker="generation")
    c.register_chunk_recv(Req("g"))
    req = Req("g")
    for i in range(3):
        p.send_chunk(req, {"codes": {"audio": [i, i]}})
    p.wait_sends()
    wait_until(lambda: c.recv_chunk())
    time.sleep(0.05)  # give the receive thread the chance to (wrongly) take more
    assert c.debug_state()["requests"]["g"]["next_recv_chunk"] == 1
    assert c.get_local_stage_payload("g")["codes"]["audio"] == [0, 0]
    c.collect_signals()  # handed to the scheduler ...
    time.sleep(0.05)
    assert c.debug_state()["requests"]["g"]["next_recv_chunk"] == 1  # ... but not yet consumed by the runner
    assert c.pop_local_stage_payload("g")["codes"]["audio"] == [0, 0]
    wait_until(lambda: c.debug_state()["requests"]["g"]["next_recv_chunk"] == 2)
    assert c.get_local_stage_payload("g")["codes"]["audio"] == [1, 1]  # replaced, not concatenated


def test_generation_worker_ignores_chunks_without_codes(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace, worker="generation")
    c.register_chunk_recv(Req("g"))
    req = Req("g")
    p.send_chunk(req, {"codes": {"audio": []}, "other": [1]})
    p.send_chunk(req, {"codes": {"audio": [5]}})
    wait_until(lambda: c.recv_chunk())
    assert c.get_local_stage_payload("g")["codes"]["audio"] == [5]
    assert "other" not in c.get_local_stage_payload("g")


def test_generation_worker_waits_for_the_scheduler_even_when_the_runner_consumed(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace, worker="generation")
    c.register_chunk_recv(Req("g"))
    req = Req("g")
    for i in range(2):
        p.send_chunk(req, {"codes": {"audio": [i]}})
    p.wait_sends()
    wait_until(lambda: c.debug_state()["requests"]["g"]["next_recv_chunk"] == 1)
    assert c.pop_local_stage_payload("g")["codes"]["audio"] == [0]  # consumed, but signals not collected yet
    time.sleep(0.1)  # give the receive thread the chance to (wrongly) take the next chunk
    assert c.debug_state()["requests"]["g"]["next_recv_chunk"] == 1
    assert "g" in c.collect_signals().chunk_ready  # handed to the scheduler: the next chunk may come
    wait_until(lambda: c.debug_state()["requests"]["g"]["next_recv_chunk"] == 2)
    assert c.get_local_stage_payload("g")["codes"]["audio"] == [1]


def test_generation_worker_takes_a_finished_chunk_without_codes(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace, worker="generation")
    c.register_chunk_recv(Req("g"))
    req = Req("g")
    p.send_chunk(req, {"codes": {"audio": [1]}})
    collect_until(c, lambda s: "g" in s.chunk_ready)
    c.pop_local_stage_payload("g")
    req.done = True
    p.send_chunk(req, {"codes": {"audio": []}})
    seen = collect_until(c, lambda s: "g" in s.chunk_finished)
    assert "g" in seen[-1].chunk_ready
    assert not c.register_chunk_recv(Req("g"))  # a finished stream is never registered again


def test_builder_gets_is_finished_only_when_it_accepts_it(runtimes: list, namespace: str) -> None:
    rt_builders.CALLS.clear()
    p = make_runtime(0, namespace, **STREAM)
    q = make_runtime(0, namespace, async_chunk=True, custom_process_next_stage_input_func="rt_builders.no_is_finished")
    runtimes += [p, q]
    req = Req("r")
    req.done = True
    p.send_chunk(req, {"x": [1]})
    assert rt_builders.CALLS[-1] == {"request": "r", "is_finished": True}
    assert q.send_chunk(Req("s"), torch.ones(1, 1))  # would raise TypeError if is_finished were passed


def test_kwargs_builder_gets_is_finished(runtimes: list, namespace: str) -> None:
    rt_builders.CALLS.clear()
    p = make_runtime(0, namespace, async_chunk=True, custom_process_next_stage_input_func="rt_builders.kw_stream")
    runtimes.append(p)
    req = Req("k")
    req.done = True
    assert p.send_chunk(req, None)
    assert rt_builders.CALLS[-1] == {"request": "k", "is_finished": True}


def test_builder_none_means_nothing_sent_and_crash_reports_failed(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    bad = make_runtime(0, namespace, async_chunk=True, custom_process_next_stage_input_func="rt_builders.crashing")
    runtimes += [p, bad]
    assert p.send_chunk(Req("r"), None) is False
    assert p.put_req_chunk["r"] == 0
    assert bad.send_chunk(Req("b"), {"x": 1}) is False
    assert bad.collect_signals().failed == {"b"}


def test_payload_is_snapshotted_at_send(runtimes: list, namespace: str) -> None:
    gate_ns = namespace
    p, c = _pair(runtimes, gate_ns)
    live_ids = [1, 2]
    live_t = torch.zeros(1, 2)
    c.register_chunk_recv(Req("r"))
    p.send_chunk(Req("r"), {"ids": {"prompt": live_ids}, "embed": {"decode": live_t}})
    live_ids.append(3)  # the runner keeps mutating its own objects
    live_t.fill_(9)
    wait_until(c.recv_chunk)
    got = c.get_local_stage_payload("r")
    assert got["ids"]["prompt"] == [1, 2] and got["embed"]["decode"].sum() == 0


def test_payload_is_snapshotted_while_the_send_thread_is_busy(runtimes: list, namespace: str) -> None:
    conn = GatedConnector(namespace)
    p = make_runtime(0, namespace, connector=conn, **STREAM)
    c = make_runtime(1, namespace, async_chunk=True)
    runtimes += [p, c]
    c.register_chunk_recv(Req("r"))
    p.send_chunk(Req("r"), {"ids": {"prompt": [0]}})
    assert conn.entered.wait(5)  # the send thread is stuck in the first put: the next chunk stays queued
    live_ids = [1, 2]
    live_t = torch.zeros(1, 2)
    p.send_chunk(Req("r"), {"ids": {"prompt": live_ids}, "embed": {"decode": live_t}})
    live_ids.append(3)  # the runner keeps mutating its own objects
    live_t.fill_(9)
    conn.gate.set()
    wait_until(lambda: c.debug_state()["requests"]["r"]["next_recv_chunk"] == 2)
    got = c.get_local_stage_payload("r")
    assert got["ids"]["prompt"] == [0, 1, 2] and got["embed"]["decode"].sum() == 0


def test_registration_guards(runtimes: list, namespace: str) -> None:
    s0 = make_runtime(0, namespace, async_chunk=True)
    c = make_runtime(1, namespace, async_chunk=True)
    runtimes += [s0, c]
    assert s0.register_chunk_recv(Req("x")) is False  # stage 0 never receives
    assert c.register_chunk_recv(Req("x", None)) is True  # explicit None external id -> request id
    assert c.register_chunk_recv(Req("x")) is False  # already registered
    assert c.debug_state()["requests"]["x"]["external_id"] == "x"


def test_polling_path_delivers(runtimes: list, namespace: str) -> None:
    conn = PollOnlyConnector(MemoryConfig(namespace=namespace))
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes += [p, c]
    assert c.arrival_mode == "poll"
    c.register_chunk_recv(Req("r"))
    p.send_chunk(Req("r"), {"embed": {"decode": torch.ones(1, 1)}})
    assert c.wait_ready(5.0)
    assert c.recv_chunk().keys() == {"r"}


@pytest.mark.parametrize("mode", ["block", "poll"])
def test_many_streams_in_order(mode: str, runtimes: list, namespace: str) -> None:
    from rt_helpers import FAST

    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, tuning=FAST.__class__(**{**FAST.__dict__, "arrival": mode}), async_chunk=True)
    runtimes += [p, c]
    n, chunks = 16, 5
    for i in range(n):
        c.register_chunk_recv(Req(f"r{i}"))
    reqs = [Req(f"r{i}") for i in range(n)]
    for k in range(chunks):
        for r in reqs:
            r.done = k == chunks - 1
            p.send_chunk(r, {"ids": {"prompt": [k]}})
    finished: set[str] = set()
    collect_until(c, lambda s: finished.update(s.chunk_finished) or len(finished) == n, timeout=10)
    for i in range(n):
        assert c.get_local_stage_payload(f"r{i}")["ids"]["prompt"] == list(range(chunks))


def test_accumulation_buffer_kept_until_the_stream_finishes(runtimes: list, namespace: str) -> None:
    p, c = _pair(runtimes, namespace)
    c.register_chunk_recv(Req("r"))
    req = Req("r")
    p.send_chunk(req, {"embed": {"decode": torch.ones(1, 2)}})
    collect_until(c, lambda s: "r" in s.chunk_ready)  # woken and collected, stream still open
    assert c.request_payload["r"]["embed"]["decode"].shape == (1, 2)
    req.done = True
    p.send_chunk(req, {"embed": {"decode": torch.ones(1, 2)}})
    collect_until(c, lambda s: "r" in s.chunk_finished)
    assert "r" not in c.request_payload


@pytest.mark.parametrize("poison", ["override_keys", "unhashable"])
def test_a_malformed_chunk_fails_its_request_only(poison: str, runtimes: list, namespace: str) -> None:
    """Chunks come from another process: one that decodes but breaks the payload rules fails its own
    request; the chunks of other requests taken in the same batch are still delivered."""
    producer = create_connector("memory", {"namespace": namespace})
    ids = ["h0", "evil", "h1", "h2"]
    bad = [{}] if poison == "unhashable" else [["embed", "decode", "extra"]]
    try:
        for i in range(3):
            for rid in ids:
                meta: dict = {"finished": i == 2}
                if rid == "evil" and i == 1:
                    meta["override_keys"] = bad
                producer.put(0, 1, f"{rid}_0_{i}", {"embed": {"decode": torch.full((1, 2), float(i))}, "meta": meta})
        c = make_runtime(1, namespace, async_chunk=True, recv_timeout_s=30)
        runtimes.append(c)
        for rid in ids:  # everything is already there: the receive thread takes it in batches
            assert c.register_chunk_recv(Req(rid))
        finished: set[str] = set()
        failed: set[str] = set()

        def done(sig: object) -> bool:
            finished.update(sig.chunk_finished)  # type: ignore[attr-defined]
            failed.update(sig.failed)  # type: ignore[attr-defined]
            return len(finished) + len(failed) == len(ids)

        collect_until(c, done)
        assert failed == {"evil"}
        assert finished == {"h0", "h1", "h2"}
        for rid in ("h0", "h1", "h2"):
            assert c.get_local_stage_payload(rid)["embed"]["decode"][:, 0].tolist() == [0.0, 1.0, 2.0]
            c.cleanup_finished_request(rid)
        c.cleanup_finished_request("evil")
        assert c.active_request_count() == 0
        assert producer.health()["keys"] == 0  # evil's unread chunk 2 was cleaned up too
    finally:
        producer.close()


def test_generation_worker_takes_a_scalar_code_tensor(runtimes: list, namespace: str) -> None:
    """A 0-d ``codes.audio`` tensor is content (one code), not a crash of the receive thread."""
    p, c = _pair(runtimes, namespace, worker="generation")
    c.register_chunk_recv(Req("g"))
    p.send_chunk(Req("g"), {"codes": {"audio": torch.tensor(7)}})
    wait_until(lambda: c.recv_chunk())
    assert c.get_local_stage_payload("g")["codes"]["audio"].item() == 7
