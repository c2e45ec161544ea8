"""Helpers for CLI tests: tiny pipelines written to tmp files."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest

TINY = """
connectors:
  c:
    name: {name}
    extra: {extra}
stages:
  - stage_id: 0
    async_chunk: true
    output_connectors: {{to_stage_1: c}}
    synthetic:
      steps: {steps}
      send: stream
      outputs:
        - {{name: hidden.states, shape: [1, 64], dtype: bfloat16}}
  - stage_id: 1
    async_chunk: true
    final_output: true
    input_connectors: {{from_stage_0: c}}
"""


def tiny_pipeline(tmp_path: Path, *, name: str = "shm", extra: str = "{}", steps: int = 4) -> Path:
    path = tmp_path / f"tiny-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(textwrap.dedent(TINY.format(name=name, extra=extra, steps=steps)))
    return path


@pytest.fixture
def shm_ns() -> str:
    pytest.importorskip("omni_plugins_shm")
    return f"cli-{uuid.uuid4().hex[:10]}"
