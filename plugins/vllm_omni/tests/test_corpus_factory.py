"""The vLLM-Omni file corpus (tests/data/vllm_omni) against vLLM-Omni's own code.

- vLLM-Omni's loaders read every corpus file into the edges omni-plugins reads (its deploy
  overlays merged as ours merge them), each edge's connector the one ours becomes;
- its real factory (``load_omni_transfer_config`` + ``create_connectors_from_config``) builds
  ``OmniPlugins`` on the backend our loader reads, from every corpus file that names it, and a
  payload crosses each such edge;
- every file loads with every check, its builder and CFG paths imported from the real vLLM-Omni;
- BAGEL's own ``collect_cfg_kv_caches``, named by a corpus file's ``cfg_kv_collect_func``, collects
  CFG companion KV through omni-plugins' runtime.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash scripts/setup.sh vllm-omni)")

import torch
from omni_plugins_vllm_omni.connector import OmniPluginsConnector
from vllm_omni.config.stage_config import resolve_deploy_yaml
from vllm_omni.distributed.omni_connectors.utils.initialization import create_connectors_from_config, load_omni_transfer_config

from omni_plugins.config import PipelineConfig, load_pipeline_config
from omni_plugins.config.overlays import resolve_overlays
from omni_plugins.config.yamldoc import YamlDoc
from omni_plugins.kv.testing import build_paged_caches, full_kv
from omni_plugins.runtime import StageTransferRuntime
from omni_plugins.services import services_for

CORPUS = Path(__file__).resolve().parents[3] / "tests" / "data" / "vllm_omni"
FILES = sorted((CORPUS / "legacy").glob("*.yaml")) + sorted((CORPUS / "deploy").glob("*.yaml"))
NAMING_OURS = [p for p in FILES if "name: OmniPlugins" in p.read_text()]
#: vLLM-Omni's connector names and what omni-plugins reads them as (the plugins' declarations)
OURS = {"SharedMemoryConnector": "shm", "MooncakeConnector": "mooncake-store", "MooncakeStoreConnector": "mooncake-store",
        "MooncakeTransferEngineConnector": "mooncake-te", "NixlConnector": "vllm-omni"}  # fmt: skip


@pytest.fixture
def corpus_env(redis_server: Any, redis_prefix: str, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables the corpus reads: the test's Redis (credentials included), key prefix and shm namespace."""
    for variable, value in services_for("redis").server_environment(redis_server).items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("OMNI_REDIS_PREFIX", redis_prefix)
    monkeypatch.setenv("OMNI_SHM_NAMESPACE", namespace)


def transfer_config(path: Path) -> Any:
    """vLLM-Omni's view of a file: a deploy file through its deploy loader (OmegaConf, overlays), a legacy one as it is."""
    if "stage_args:" in path.read_text():
        return load_omni_transfer_config(path)
    return load_omni_transfer_config(config_dict=resolve_deploy_yaml(path))


def replica_of(cfg: PipelineConfig) -> dict[int, int]:
    """Stage id -> the stage omni-plugins reads it as (prefill/decode stages folded into replicas of one)."""
    out = {s.stage_id: s.stage_id for s in cfg.stages}
    for s in cfg.stages:
        for other in s.vllm_omni.get("replica_stages", {}):
            out[int(other)] = s.stage_id
    return out


def test_the_corpus_names_our_connector_in_both_layouts() -> None:
    names = {p.relative_to(CORPUS).parts[0] for p in NAMING_OURS}
    assert names == {"legacy", "deploy"} and len(NAMING_OURS) >= 4


@pytest.mark.usefixtures("corpus_env")
def test_vllm_omni_and_omni_plugins_read_the_same_edges_from_every_file() -> None:
    for path in FILES:
        ours = load_pipeline_config(path)  # every check: builder and CFG paths import from the real vLLM-Omni
        fold = replica_of(ours)
        theirs = transfer_config(path).connectors
        want = {(fold[int(a)], fold[int(b)]): spec.name for (a, b), spec in theirs.items()}
        got = {(e.from_stage, e.to_stage): ours.connectors[e.connector].name for e in ours.edge_list()}
        assert set(got) == set(want), path
        for edge, name in want.items():
            expect = ours.connectors[ours.edge_list()[[(e.from_stage, e.to_stage) for e in ours.edge_list()].index(edge)].connector]
            if name == "OmniPlugins":
                assert expect.builder_settings["backend"] == got[edge], (path, edge)
            else:
                assert OURS[name] == got[edge], (path, edge)


@pytest.mark.usefixtures("corpus_env")
def test_deploy_overlays_merge_as_vllm_omni_merges_them() -> None:
    for path in FILES:
        if "base_config:" not in path.read_text():
            continue
        merged = resolve_overlays(YamlDoc.read(path, None), None)
        assert merged is not None and merged[0] == resolve_deploy_yaml(path), path


@pytest.mark.usefixtures("corpus_env")
def test_the_real_factory_builds_our_connector_from_every_file_that_names_it() -> None:
    built = 0
    for path in NAMING_OURS:
        ours = load_pipeline_config(path)
        by_edge = {(e.from_stage, e.to_stage): ours.connectors[e.connector] for e in ours.edge_list()}
        for (a, b), spec in transfer_config(path).connectors.items():
            if spec.name != "OmniPlugins":
                continue
            sender = create_connectors_from_config({(a, b): spec}, caller_stage_id=int(a))[(a, b)]
            receiver = create_connectors_from_config({(a, b): spec}, caller_stage_id=int(b))[(a, b)]
            try:
                assert isinstance(sender, OmniPluginsConnector) and isinstance(receiver, OmniPluginsConnector)
                expect = by_edge[(int(a), int(b))]
                assert sender.backend.name == expect.name, (path, a, b)  # the backend our loader reads the edge as
                assert sender.settings.backend_config == expect.extra, (path, a, b)  # with the same settings
                key = f"corpus-{uuid.uuid4().hex[:8]}_{a}_0"
                chunk = {"hidden": torch.randn(2, 8).to(torch.bfloat16), "meta": {"finished": torch.tensor(True)}}
                assert sender.put(from_stage=a, to_stage=b, put_key=key, data=chunk)[0], (path, a, b)
                got = receiver.get(from_stage=a, to_stage=b, get_key=key)
                assert got is not None and torch.equal(got[0]["hidden"], chunk["hidden"]), (path, a, b)
                built += 1
            finally:
                sender.close()
                receiver.close()
    assert built >= 5


class _Request:
    def __init__(self, request_id: str, **kw: Any) -> None:
        self.request_id = request_id
        self.external_req_id = request_id
        self.__dict__.update(kw)


def test_bagel_collects_cfg_companion_kv_through_our_runtime(namespace: str) -> None:
    """The DiT stage of a corpus BAGEL file names vLLM-Omni's collect_cfg_kv_caches; our runtime calls it as vLLM-Omni does."""
    cfg = load_pipeline_config(CORPUS / "legacy" / "bagel_inline_transfer_engine.yaml", check_plugins=False)
    thinker, dit = cfg.stage(0), cfg.stage(1).model_copy(update={"recv_timeout_s": 5.0})
    assert dit.cfg_kv_collect_func == "vllm_omni.model_executor.stage_input_processors.bagel.collect_cfg_kv_caches"
    conn = {"name": "memory", "extra": {"namespace": namespace}}
    sender, receiver = StageTransferRuntime(thinker, conn), StageTransferRuntime(dit, conn)
    try:
        kvs = {rid: full_kv(f"ext-{rid}", num_layers=2, seq_len=5, num_heads=2, head_dim=4) for rid in ("r", "r__cfg_text")}
        caches, finished = build_paged_caches(kvs, block_size=4)
        for rid in kvs:
            sender.mark_kv_transfer(rid, finished[rid]["seq_len"], finished[rid]["block_ids"])
        todo = sender.drain_pending_kv_transfers()
        assert sorted(sender.send_kv_cache(todo, caches, 4, "float32", request_id_resolver=lambda rid: f"ext-{rid}")) == ["r", "r__cfg_text"]
        req = _Request("ext-r", sampling_params=SimpleNamespace(cfg_kv_request_ids={"cfg_text": "ext-r__cfg_text"}))
        assert receiver.receive_multi_kv_cache(req) is True
        companion = req.sampling_params.cfg_text_past_key_values
        assert torch.equal(companion.key_cache[0], kvs["r__cfg_text"][0][0]) and "cfg_text_kv_metadata" in vars(req.sampling_params)
        assert torch.equal(req.past_key_values.key_cache[0], kvs["r"][0][0])
        for rid in kvs:
            sender.cleanup_finished_request(rid)
            receiver.cleanup_finished_request(f"ext-{rid}")
    finally:
        sender.shutdown()
        receiver.shutdown()
