"""``--start-servers``: which servers a file needs is read before the variables they provide are set."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from omni_plugins.errors import ConfigError
from omni_plugins.pipeline.servers import connector_names

REDIS_ENV, MOONCAKE_ENV = "OMNI_REDIS_URL", "OMNI_MOONCAKE_MASTER"

NO_DEFAULTS = """
connectors:
  r: {name: redis, extra: {url: "${OMNI_REDIS_URL}"}}
  m: {name: mooncake-store, extra: {master_address: "${OMNI_MOONCAKE_MASTER}"}}
stages:
  - {stage_id: 0, output_connectors: {to_stage_1: r}}
  - {stage_id: 1, input_connectors: {from_stage_0: r}, output_connectors: {to_stage_2: m}}
  - {stage_id: 2, input_connectors: {from_stage_1: m}}
"""


def test_server_variables_without_default_need_no_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REDIS_ENV, raising=False)
    monkeypatch.delenv(MOONCAKE_ENV, raising=False)
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(NO_DEFAULTS))
    assert connector_names(path) == {"redis", "mooncake-store"}


def test_other_unset_variables_are_still_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_TEST_NOT_SET", raising=False)
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(NO_DEFAULTS).replace("${OMNI_REDIS_URL}", "${OMNI_TEST_NOT_SET}"))
    with pytest.raises(ConfigError, match="OMNI_TEST_NOT_SET"):
        connector_names(path)
