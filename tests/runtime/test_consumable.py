"""Finished / consumable predicates and scheduling metadata, incl. legacy flat keys."""

from __future__ import annotations

import logging

import pytest
import torch

from omni_plugins.runtime.consumable import payload_audio_codes, payload_finished, payload_is_consumable, scheduling_metadata


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"meta": {"finished": True}}, True),
        ({"meta": {"finished": False}}, False),
        ({"meta": {"finished": torch.tensor([1])}}, True),
        ({"meta": {"finished": torch.tensor([0])}}, False),
        ({"meta": {"finished": torch.tensor([1, 1])}}, False),  # not one element
        ({"meta": {}}, False),
        ("not a dict", False),
    ],
)
def test_finished(payload: object, expected: bool) -> None:
    assert payload_finished(payload) is expected


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"embed": {"decode": torch.ones(1, 4)}}, True),
        ({"embed": {"decode": torch.ones(0, 4)}}, False),
        ({"embed": {"decode": torch.tensor(3.0)}}, True),
        ({"codes": {"audio": [1]}}, True),
        ({"codes": {"audio": []}}, False),
        ({"codes": {"audio": torch.zeros(0)}}, False),
        ({"meta": {"finished": True, "next_stage_prompt_len": 5, "left_context_size": 2, "override_keys": ["x"]}}, False),
        ({"embed": {"decode_token_start": 0, "decode_token_end": 8}}, False),  # widened horizon only
        ({"ids": {"output": [1, 2]}}, False),
        ({"ids": {"prompt": [1, 2]}}, True),
        ({"thinker_reply": torch.ones(2)}, True),
        ({"thinker_reply": None, "empty": []}, False),
        ({}, False),
        ({"finished": True, "next_stage_prompt_len": 5, "left_context_size": 2}, False),  # legacy flat metadata only
    ],
)
def test_consumable(payload: dict, expected: bool) -> None:
    assert payload_is_consumable(payload) is expected


def test_metadata_nested() -> None:
    codes = torch.arange(4)
    md = scheduling_metadata({"meta": {"next_stage_prompt_len": 9, "left_context_size": 3}, "codes": {"audio": codes}})
    assert md["next_stage_prompt_len"] == 9 and md["left_context_size"] == 3 and md["code_predictor_codes"] is codes
    assert scheduling_metadata({"embed": {"decode": torch.ones(1)}}) == {}


def test_legacy_flat_keys_accepted_with_one_time_warning(caplog: pytest.LogCaptureFixture) -> None:
    legacy = {"next_stage_prompt_len": 4, "left_context_size": 1, "code_predictor_codes": [7], "finished": True}
    with caplog.at_level(logging.WARNING, logger="omni_plugins.runtime.consumable"):
        for _ in range(3):
            md = scheduling_metadata(legacy)
            assert payload_finished(legacy) is True
            assert payload_audio_codes(legacy) == [7]
    assert md == {"next_stage_prompt_len": 4, "left_context_size": 1, "code_predictor_codes": [7]}
    warnings = [r.getMessage() for r in caplog.records if "legacy flat" in r.getMessage()]
    assert len(warnings) == 4  # one per key, not one per call
    assert any("'meta.next_stage_prompt_len'" in w for w in warnings)


def test_nested_wins_over_legacy() -> None:
    assert scheduling_metadata({"meta": {"next_stage_prompt_len": 1}, "next_stage_prompt_len": 2})["next_stage_prompt_len"] == 1


@pytest.mark.parametrize(
    "payload",
    [
        {"meta": {"finished": True}, "embed": {"decode": torch.ones(1, 4)}},
        {"meta": {"finished": False}, "embed": {"decode": torch.ones(0, 4)}},
        {"meta": {"finished": torch.tensor([1])}, "embed": {"decode": torch.tensor(3.0)}},
        {"meta": {"finished": False}, "embed": {"decode": torch.ones(2, 0)}},  # no elements, first dim > 0
        {"meta": {}, "embed": {"decode": torch.ones(3)}},
        {"finished": True, "embed": {"decode": torch.ones(1, 2)}},  # legacy flat finished
        {"meta": {"finished": True}, "codes": {"audio": [1]}},
        {"meta": {"finished": False}, "embed": {"decode_token_start": 0, "decode_token_end": 8}},
        {"meta": {"finished": False}, "embed": {"decode": [1, 2]}},  # not a tensor: the general predicate
        {"embed": {"decode": None}, "ids": {"prompt": [1]}},
        {"meta": "not a section", "embed": "neither"},
        {},
    ],
)
def test_chunk_flags_agree_with_the_two_predicates(payload: dict) -> None:
    from omni_plugins.runtime.consumable import chunk_flags

    assert chunk_flags(payload) == (payload_finished(payload), payload_is_consumable(payload))
