"""The YAML pipeline loader under hypothesis: any text gives a PipelineConfig or a ConfigError -- never
another exception, a hang, or an expansion blow-up (aliases). ``tests/core/test_config.py`` holds the
named bad-config cases; this is the unnamed remainder. Long runs: ``benchmarks/fuzz/fuzz_config.py``.
"""

from __future__ import annotations

import string
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_plugins.config import PipelineConfig, parse_pipeline_config
from omni_plugins.errors import ConfigError
from omni_plugins.testing.configs import SAMPLE_PIPELINE_YAML

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

GOOD = SAMPLE_PIPELINE_YAML
#: builder paths the structured strategy may name (never arbitrary modules: importing runs their code)
BUILDERS = ["omni_plugins.testing.builders.passthrough", "omni_plugins.testing.builders:wrong_signature", "nope.mod.fn", "", "x"]
KEYS = [
    "connectors", "stages", "default_connector", "stage_id", "name", "extra", "worker_type", "async_chunk", "final_output",
    "model_stage", "input_connectors", "output_connectors", "from_stage_0", "to_stage_1", "to_stage_0", "rank_mapping",
    "from_tp", "to_tp", "tp_size", "kv_transfer", "recv_timeout_s", "namespace", "stage_args", "engine_args", "runtime",
    "custom_process_next_stage_input_func", "<<",
    # vLLM-Omni's layouts
    "platforms", "npu", "edges", "from", "to", "engine_input_source", "num_replicas", "tensor_parallel_size", "omni_kv_config",
    "need_send_cache", "need_recv_cache", "is_prefill_only", "is_decode_only", "pd_prefill_pick_strategy", "devices",
    "cfg_kv_collect_func", "backend", "backend_config",
]  # fmt: skip


def load(text: str, *, builders: bool = False) -> Any:
    """Parse; anything but a PipelineConfig or a ConfigError fails the test."""
    try:
        result = parse_pipeline_config(text, env={"NS": "n", "PORT": "6379", "WEIRD": "[1, *a"}, check_builders=builders)
    except ConfigError as exc:
        assert str(exc).strip(), "empty error message"
        return exc
    assert isinstance(result, PipelineConfig)
    return result


@FUZZ
@given(st.text(max_size=400))
def test_arbitrary_text(text: str) -> None:
    load(text)


@FUZZ
@given(st.text(alphabet=string.printable, max_size=60), st.integers(0, len(GOOD)), st.integers(0, 40))
def test_mutated_good_config(insert: str, at: int, cut: int) -> None:
    load(GOOD[:at] + insert + GOOD[at + cut :])


TEXTS = [
    "${NS}", "${MISSING}", "${PORT}", "${WEIRD}", "$", "${", "memory", "shm", "redis", "ar", "generation",
    "${oc.env:NS,x}", "SharedMemoryConnector", "OmniPlugins", "NixlConnector", "round_robin",
]  # fmt: skip
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12), st.sampled_from(BUILDERS),
    st.sampled_from(TEXTS),
)  # fmt: skip
trees = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), children, max_size=5)
    ),
    max_leaves=25,
)


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), trees, max_size=5))
def test_structured_documents(doc: dict[str, Any]) -> None:
    load(yaml.safe_dump(doc), builders=True)


@pytest.mark.parametrize(
    "text",
    [
        "stages: &a [ *a ]",
        "stages: &a {x: *a}",
        "a: &a [1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b]\n"
        "d: &d [*c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e]\n"
        "stages: [*f, *f, *f, *f, *f, *f, *f, *f]",
        "{[1, 2]: 3}",
        "? !!set {a: null}\n: 1",
        "stages: [{stage_id: 1" + "0" * 5000 + "}]",
        "stages: " + "[" * 1200 + "]" * 1200,
        "base: &b {stage_id: 0}\nstages: [{<<: *b}]",
        "x-a: &a {k0: 1, k1: 1, k2: 1, k3: 1, k4: 1, k5: 1, k6: 1, k7: 1}\n"
        + "".join(f"x-{i}: &{i} {{<<: [{', '.join([f'*{i - 1}' if i > 1 else '*a'] * 8)}]}}\n" for i in range(1, 12))
        + "stages: [{stage_id: 0}]",
        "stages: !!python/object/apply:os.system ['true']",
        "stages: [{stage_id: 0, model_stage: ${WEIRD}}]",
        "\x00\x01",
        "stages: [{stage_id: !!binary AAAA}]",
    ],
    ids=[
        "recursive-seq",
        "recursive-map",
        "alias-bomb",
        "list-key",
        "set-key",
        "huge-int",
        "deep",
        "merge-key",
        "merge-bomb",
        "python-tag",
        "env-yaml",
        "control-chars",
        "binary",
    ],
)
def test_hostile_documents_are_config_errors(text: str) -> None:
    assert isinstance(load(text), ConfigError)
