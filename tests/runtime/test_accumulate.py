"""Full-payload accumulation, chunk merge for "ar" workers, token-span merge."""

from __future__ import annotations

import random

import torch

from omni_plugins.runtime.accumulate import FullPayloadAccumulator, PendingCat, merge_chunk, resolve_pending
from omni_plugins.runtime.spans import Span, get_span, merge_spans


def test_accumulator_concats_token_tensors_and_keeps_latest_scalars() -> None:
    acc = FullPayloadAccumulator()
    acc.add({"hidden": torch.ones(2, 3), "step": 1, "vec": torch.zeros(3)})
    acc.add({"hidden": torch.full((1, 3), 2.0), "step": 2, "vec": torch.ones(3)})
    out = acc.materialize()
    assert out["hidden"].shape == (3, 3) and out["hidden"][2, 0] == 2.0
    assert out["step"] == 2
    assert torch.equal(out["vec"], torch.ones(3))  # 1-D: latest, never concatenated


def test_accumulator_defers_concat_until_materialize() -> None:
    acc = FullPayloadAccumulator()
    for i in range(5):
        acc.add({"hidden": torch.full((1, 2), float(i))})
    assert acc.steps == {"hidden": 5}  # parts held as a list
    assert acc.materialize()["hidden"][:, 0].tolist() == [0, 1, 2, 3, 4]


def test_accumulator_trailing_dim_mismatch_restarts_key() -> None:
    acc = FullPayloadAccumulator()
    acc.add({"h": torch.ones(2, 3)})
    acc.add({"h": torch.ones(4, 5)})
    assert acc.materialize()["h"].shape == (4, 5)


def test_accumulator_replace_keys_never_concat() -> None:
    acc = FullPayloadAccumulator(replace_keys={"model_outputs"})
    acc.add({"model_outputs": torch.ones(2, 3), "h": torch.ones(1, 3)})
    acc.add({"model_outputs": torch.full((3, 3), 5.0), "h": torch.ones(1, 3)})
    out = acc.materialize()
    assert out["model_outputs"].shape == (3, 3) and out["model_outputs"][0, 0] == 5.0
    assert out["h"].shape == (2, 3)


def test_accumulator_ignores_none_and_switching_types() -> None:
    acc = FullPayloadAccumulator()
    acc.add({"h": torch.ones(2, 2), "x": 1})
    acc.add({"h": None, "x": None})
    out = acc.materialize()
    assert out["h"].shape == (2, 2) and out["x"] == 1
    acc.add({"h": "now a string"})
    assert acc.materialize()["h"] == "now a string"


def test_accumulator_non_mapping_output_keeps_the_latest() -> None:
    acc = FullPayloadAccumulator()
    acc.add({"h": torch.ones(1, 2)})
    acc.add([1, 2])  # a raw output (not a dict of fields) replaces what was accumulated
    acc.add([3])
    assert acc.materialize() == [3]
    acc.add({"h": torch.ones(1, 2)})
    assert acc.materialize()["h"].shape == (1, 2)


def test_merge_chunk_concat_extend_and_nested() -> None:
    a = {"embed": {"prefill": torch.ones(2, 4)}, "ids": {"output": [1, 2]}, "top": torch.zeros(1, 2), "extra": {"d": {"x": [1]}}}
    b = {"embed": {"prefill": torch.ones(1, 4)}, "ids": {"output": [3]}, "top": torch.ones(2, 2), "extra": {"d": {"x": [2]}}}
    m = merge_chunk(merge_chunk(None, a), b)
    assert m["embed"]["prefill"].shape == (3, 4)
    assert m["ids"]["output"] == [1, 2, 3]
    assert m["top"].shape == (3, 2)
    assert m["extra"]["d"]["x"] == [1, 2]
    assert a["ids"]["output"] == [1, 2]  # inputs untouched


def test_merge_chunk_finished_and_override_keys_replace() -> None:
    a = {"meta": {"finished": False}, "codes": {"audio": [1, 2]}, "lst": [1], "ids": {"output": [1]}}
    b = {
        "meta": {"finished": True, "override_keys": [["codes", "audio"], "lst"]},
        "codes": {"audio": [9]},
        "lst": [2],
        "ids": {"output": [2]},
    }
    m = merge_chunk(a, b)
    assert m["meta"]["finished"] is True
    assert m["codes"]["audio"] == [9]
    assert m["lst"] == [2]
    assert m["ids"]["output"] == [1, 2]  # not overridden: extends


def test_merge_chunk_tensor_finished_flag_replaces() -> None:
    # a one-element tensor ``meta.finished`` would concatenate under the default merge
    a = {"meta": {"finished": torch.tensor([False])}, "embed": {"decode": torch.ones(1, 2)}}
    b = {"meta": {"finished": torch.tensor([True])}, "embed": {"decode": torch.ones(1, 2)}}
    for lazy in (False, True):
        m = merge_chunk(merge_chunk(None, a), b, lazy=lazy)
        assert m["meta"]["finished"].tolist() == [True]


def test_merge_chunk_token_span_union_newer_wins() -> None:
    old = {"embed": {"decode": torch.zeros(4, 2), "decode_token_start": 0, "decode_token_end": 4}}
    new = {"embed": {"decode": torch.ones(4, 2), "decode_token_start": 2, "decode_token_end": 6}}
    m = merge_chunk(old, new)["embed"]
    assert (m["decode_token_start"], m["decode_token_end"]) == (0, 6)
    assert m["decode"][:, 0].tolist() == [0, 0, 1, 1, 1, 1]


def test_merge_chunk_span_without_offsets_falls_back_to_concat() -> None:
    m = merge_chunk({"embed": {"decode": torch.zeros(2, 2)}}, {"embed": {"decode": torch.ones(1, 2)}})
    assert m["embed"]["decode"].shape == (3, 2)


def test_span_merge_edge_cases() -> None:
    a = Span(torch.zeros(2, 1), 0, 2)
    assert merge_spans(a, None) is a and merge_spans(None, a) is a
    gap = merge_spans(a, Span(torch.ones(2, 1), 5, 7))
    assert gap is not None and (gap.start, gap.end) == (5, 7)  # disjoint with a gap: newer alone
    inside = merge_spans(Span(torch.zeros(6, 1), 0, 6), Span(torch.ones(2, 1), 2, 4))
    assert inside is not None and inside.tensor[:, 0].tolist() == [0, 0, 1, 1, 0, 0]
    adjacent = merge_spans(a, Span(torch.ones(1, 1), 2, 3))
    assert adjacent is not None and (adjacent.start, adjacent.end) == (0, 3)
    assert get_span({"decode": torch.ones(3, 1), "s": 0, "e": 5}, "decode", "s", "e") is None  # length mismatch
    tensor_offsets = get_span({"decode": torch.ones(3, 1), "s": torch.tensor(4)}, "decode", "s", "e")
    assert tensor_offsets is not None and (tensor_offsets.start, tensor_offsets.end) == (4, 7)


def test_merge_value_moves_a_chunk_on_another_device_to_the_accumulation() -> None:
    """cat refuses tensors on two devices; the merge then moves the new one to the accumulation's
    device (the meta device stands in for an accelerator here) and concatenates."""
    from omni_plugins.runtime.accumulate import merge_value

    old = torch.ones(2, 3, device="meta")
    merged = merge_value(old, torch.ones(1, 3))
    assert merged.device == old.device and merged.shape == (3, 3)
    assert merge_value(torch.ones(2, 3), torch.ones(1, 4)).shape == (1, 4)  # trailing dims differ: replaced


def _random_chunk(rng: random.Random) -> dict:
    """A chunk drawn from the layouts the merge treats differently (spans, overrides, shapes, types)."""
    chunk: dict = {}
    if rng.random() < 0.8:
        embed: dict = {"decode": torch.randn(rng.choice((0, 1, 2)), rng.choice((3, 3, 3, 4)))}
        if rng.random() < 0.25:  # a token span: rows [start, start + n)
            start = rng.randrange(0, 6)
            embed["decode_token_start"] = start
            if rng.random() < 0.5:
                embed["decode_token_end"] = start + embed["decode"].shape[0]
        if rng.random() < 0.3:
            embed["prefill"] = torch.randn(1, 2) if rng.random() < 0.8 else torch.tensor(1.0)
        chunk["embed"] = embed
    if rng.random() < 0.5:
        chunk["codes"] = {"audio": torch.randint(0, 9, (rng.choice((1, 2)), 2))}
    if rng.random() < 0.5:
        chunk["ids"] = {"output": [rng.randrange(9)], "mixed": torch.ones(1, 2) if rng.random() < 0.5 else [1]}
    if rng.random() < 0.3:
        chunk["top"] = torch.randn(1, 2)
    meta: dict = {"finished": rng.random() < 0.1}
    if rng.random() < 0.15:
        meta["override_keys"] = [rng.choice((["embed", "decode"], ["ids", "output"], "top", "embed"))]
    chunk["meta"] = meta
    return chunk


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_lazy_merge_resolves_to_exactly_the_eager_merge() -> None:
    """Differential: 300 random streams, each read at random points (resolve) or never until the end."""
    rng = random.Random(7)
    for _ in range(300):
        eager = lazy = None
        for _ in range(rng.randrange(1, 9)):
            chunk = _random_chunk(rng)
            eager = merge_chunk(eager, chunk)
            lazy = merge_chunk(lazy, chunk, lazy=True)
            if rng.random() < 0.3:  # the model thread reads in between
                resolve_pending(lazy)
                assert _same(lazy, eager)
        resolve_pending(lazy)
        assert _same(lazy, eager)


def test_lazy_merge_leaves_tensors_pending_and_inputs_untouched() -> None:
    a = {"embed": {"decode": torch.zeros(1, 2)}, "meta": {"finished": False}, "codes": {"audio": torch.zeros(1, 2)}}
    b = {"embed": {"decode": torch.ones(1, 2)}, "meta": {"finished": False}, "codes": {"audio": torch.ones(1, 2)}}
    m = merge_chunk(merge_chunk(None, a), b, lazy=True)
    m = merge_chunk(m, b, lazy=True)
    pending = m["embed"]["decode"]
    assert isinstance(pending, PendingCat) and len(pending.parts) == 3
    assert isinstance(m["codes"]["audio"], torch.Tensor) and m["codes"]["audio"].shape == (3, 2)  # read per chunk: eager
    assert a["embed"]["decode"].shape == (1, 2) and b["embed"]["decode"].shape == (1, 2)
    resolve_pending(m)
    assert m["embed"]["decode"][:, 0].tolist() == [0, 1, 1]


def test_pending_cat_moves_parts_on_another_device_and_drops_one_that_cannot_join() -> None:
    accumulated = torch.ones(2, 3, device="meta")
    joined = PendingCat([accumulated, torch.ones(1, 3)]).resolve()
    assert joined.device == accumulated.device and joined.shape == (3, 3)
    # a part cat refuses even on one device (here: a sparse tensor) is dropped, as the eager merge drops that chunk
    odd = torch.ones(1, 3).to_sparse()
    kept = PendingCat([torch.zeros(1, 3), odd, torch.ones(1, 3)]).resolve()
    assert kept.shape == (2, 3) and kept[:, 0].tolist() == [0, 1]
