"""The stage graph as runtimes see it: edges merged from both ends, keys, KV edges, per-stage connectors."""

from __future__ import annotations

from omni_plugins.config import Edge, parse_pipeline_config

HYBRID_FANOUT = """
connectors:
  net: {name: memory, extra: {namespace: net}}
  local: {name: memory, extra: {namespace: local}}
  kvnet: {name: memory, extra: {namespace: kv}}
stages:
  - stage_id: 0
    kv_transfer: true
    output_connectors:
      to_stage_1: {connector: net, kv_connector: kvnet}
      to_stage_2: {connector: local, payload_builder: omni_plugins.testing.builders.passthrough}
  - stage_id: 1
    kv_transfer: true
    replicas: 2
    routing: least_inflight
    input_connectors: {from_stage_0: {connector: net, kv_connector: kvnet}}
    output_connectors: {to_stage_3: local}
  - stage_id: 2
    input_connectors: {from_stage_0: local}
  - stage_id: 3
    input_connectors: {from_stage_1: local, from_stage_2: local}
"""


def _config():  # type: ignore[no-untyped-def]
    return parse_pipeline_config(HYBRID_FANOUT, filename="p.yaml")


def test_edges_merge_both_ends_and_an_edge_written_on_one_end_counts() -> None:
    edges = {(e.from_stage, e.to_stage): e for e in _config().edge_list()}
    assert sorted(edges) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    assert edges[(0, 1)] == Edge(0, 1, "net", "kvnet", None, "0-1", kv=True)
    assert edges[(0, 2)].payload_builder == "omni_plugins.testing.builders.passthrough"  # from the sending end
    assert edges[(2, 3)].connector == "local" and edges[(2, 3)].kv_connector == "local"  # kv_connector defaults to the connector
    assert not edges[(1, 3)].kv  # stage 3 has no kv_transfer: not a KV edge


def test_a_fanning_out_stage_keys_per_destination_and_a_single_edge_keys_as_the_reference() -> None:
    edges = {(e.from_stage, e.to_stage): e.key_stage for e in _config().edge_list()}
    assert edges == {(0, 1): "0-1", (0, 2): "0-2", (1, 3): "1", (2, 3): "2"}


def test_stage_topology_lists_its_edges_and_every_connector_they_use() -> None:
    cfg = _config()
    head = cfg.topology(0)
    assert [e.to_stage for e in head.outputs] == [1, 2] and head.inputs == ()
    assert list(head.connectors) == ["net", "kvnet", "local"]
    assert [e.to_stage for e in head.kv_outputs] == [1]
    talker = cfg.topology(1)
    assert talker.kv_input is not None and talker.kv_input.from_stage == 0
    assert set(talker.connectors) == {"net", "kvnet", "local"}
    sink = cfg.topology(3)
    assert [e.from_stage for e in sink.inputs] == [1, 2] and list(sink.connectors) == ["local"]
    assert cfg.stage(1).replicas == 2 and cfg.stage(1).routing_policy == "least_inflight"
    assert cfg.stage(2).routing_policy == "round_robin"  # the default


def test_short_and_mapping_edge_forms_are_the_same_edge() -> None:
    short = parse_pipeline_config(
        "connectors: {c: {name: memory}}\nstages:\n  - {stage_id: 0, output_connectors: {to_stage_1: c}}\n  - {stage_id: 1}\n"
    )
    long = parse_pipeline_config(
        "connectors: {c: {name: memory}}\nstages:\n  - {stage_id: 0, output_connectors: {to_stage_1: {connector: c}}}\n  - {stage_id: 1}\n"
    )
    assert short.edge_list() == long.edge_list() == [Edge(0, 1, "c", "c", None, "0", kv=False)]
    assert short.stage(0).output_stages() == {1: "c"}


def test_round_robin_takes_replicas_in_turn_and_skips_retired_ones() -> None:
    import pytest

    from omni_plugins.routing import NoReplicaError, ReplicaRouter

    rr = ReplicaRouter(3)
    assert [rr.pick() for _ in range(4)] == [0, 1, 2, 0]
    rr.retire(1)
    assert [rr.pick() for _ in range(3)] == [2, 0, 2]
    rr.retire(0)
    rr.retire(2)
    with pytest.raises(NoReplicaError):
        rr.pick()


def test_least_inflight_takes_the_replica_holding_fewest_requests() -> None:
    from omni_plugins.routing import ReplicaRouter

    li = ReplicaRouter(2, "least_inflight")
    assert [li.pick(), li.pick(), li.pick()] == [0, 1, 0]  # ties go to the lowest index
    li.done(0)
    li.done(0)
    assert li.pick() == 0 and li.inflight == [1, 1] and li.routed == [3, 1]
    li.retire(0)
    assert li.pick() == 1
