"""Payload-builder loading, signature checks and the full-payload derivation."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_plugins import BuilderError
from omni_plugins.payload import accepts_builder_kwargs, full_payload_candidates, load_builder, resolve_stage_builder

B = "omni_plugins.testing.builders"


def test_load_by_dotted_and_colon_path() -> None:
    a = load_builder(f"{B}.passthrough")
    b = load_builder(f"{B}:passthrough")
    assert a.func is b.func
    assert a.accepts_is_finished is True
    assert a.replace_keys == frozenset({"meta"})


def test_is_finished_is_passed_only_when_accepted() -> None:
    with_flag = load_builder(f"{B}.passthrough")
    out = with_flag(transfer_manager=None, pooling_output={"x": 1}, request=None, is_finished=True)
    assert out == {"x": 1, "meta": {"finished": True}}
    without = load_builder(f"{B}.passthrough_full_payload")
    assert without.accepts_is_finished is False
    assert without(transfer_manager=None, pooling_output={"x": 1}, request=None, is_finished=False)["meta"]["finished"] is True


def test_kwargs_builder_accepted() -> None:
    assert accepts_builder_kwargs(load_builder(f"{B}.via_kwargs").func)
    assert load_builder(f"{B}.via_kwargs").accepts_is_finished


def test_a_builder_may_name_the_output_multimodal_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM-Omni's streaming builders take the model output as multimodal_output: called by that name."""
    (tmp_path / "vo_builders.py").write_text(
        "def stream(transfer_manager, multimodal_output, request, is_finished=False):\n"
        "    return {'out': multimodal_output, 'done': is_finished}\n"
        "def neither(transfer_manager, output, request):\n    return output\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    builder = load_builder("vo_builders.stream")
    assert builder.output_kwarg == "multimodal_output"
    assert builder(transfer_manager=None, pooling_output=7, request=None, is_finished=True) == {"out": 7, "done": True}
    with pytest.raises(BuilderError, match="pooling_output may be named multimodal_output"):
        load_builder("vo_builders.neither")


def test_wrong_signature_rejected_with_signature_in_message() -> None:
    with pytest.raises(BuilderError, match=r"\(output: 'Any'\)|\(output"):
        load_builder(f"{B}.wrong_signature")


def test_import_crash_in_builder_module_is_a_builder_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "crashy_builders.py").write_text("raise ZeroDivisionError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BuilderError, match="ZeroDivisionError: boom"):
        load_builder("crashy_builders.make")


def test_full_payload_derivation_order_and_skipping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "derive_mod.py").write_text(
        "def proc_full_payload(x):\n    return x\n"  # wrong signature: skipped
        "def proc_batch(transfer_manager, pooling_output, request):\n    return 'batch'\n"
        "def proc(transfer_manager, pooling_output, request):\n    return 'plain'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert full_payload_candidates("derive_mod.proc") == ["derive_mod.proc_full_payload", "derive_mod.proc_batch", "derive_mod.proc"]
    chosen = resolve_stage_builder(None, "derive_mod.proc", full_payload=True)
    assert chosen is not None and chosen.path == "derive_mod.proc_batch"
    assert resolve_stage_builder(None, "derive_mod.proc", full_payload=False) is None
    explicit = resolve_stage_builder("derive_mod.proc", "derive_mod.other", full_payload=True)
    assert explicit is not None and explicit.path == "derive_mod.proc"
    assert resolve_stage_builder(None, "derive_mod.missing", full_payload=True) is None
