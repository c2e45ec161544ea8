"""Extraction from every supported paged-cache layout, against references built by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_plugins.kv import KVLayoutError, KVPayloadError, normalize_caches
from omni_plugins.kv.testing import build_paged_caches, full_kv

BLOCK = 4


def _token_by_token(blocks: torch.Tensor, block_ids: list[int], seq_len: int, layout: str) -> torch.Tensor:
    """Reference: read each token's row from its block, one at a time."""
    rows = []
    for t in range(seq_len):
        b, off = block_ids[t // BLOCK], t % BLOCK
        rows.append(blocks[b, off] if layout == "nhd" else blocks[b, :, off])
    return torch.stack(rows)


def _layer_blocks(caches: object, form: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if form == "mapping":
        return caches["key_cache"][layer], caches["value_cache"][layer]  # type: ignore[index]
    entry = caches[layer]  # type: ignore[index]
    return (entry[0], entry[1])


@pytest.mark.parametrize("form", ["stacked", "pairs", "mapping"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("seed", [0, 1])
def test_extraction_matches_reference(form: str, layout: str, seed: int) -> None:
    heads = 3 if layout == "nhd" else 5  # != BLOCK, so "auto" is unambiguous
    entries = {
        f"r{i}": full_kv(f"r{i}-{seed}", num_layers=3, seq_len=seq, num_heads=heads, head_dim=2, missing_layers=(1,))
        for i, seq in enumerate([1, 4, 9, 13])  # partial first block, exact block, several blocks with a ragged tail
    }
    caches, finished = build_paged_caches(entries, block_size=BLOCK, form=form, layout=layout, seed=seed)  # type: ignore[arg-type]
    all_ids = [b for info in finished.values() for b in info["block_ids"]]
    assert all_ids != sorted(all_ids)  # shuffled: a reader that ignores block_ids fails
    for explicit in ("auto", layout):
        paged = normalize_caches(caches, BLOCK, explicit)
        assert paged.layout == layout
        for rid, info in finished.items():
            keys, values = paged.gather(info["block_ids"], info["seq_len"])
            assert keys[1] is None and values[1] is None
            for layer in (0, 2):
                k_blocks, v_blocks = _layer_blocks(caches, form, layer)
                ref_k = _token_by_token(k_blocks, info["block_ids"], info["seq_len"], layout)
                ref_v = _token_by_token(v_blocks, info["block_ids"], info["seq_len"], layout)
                assert keys[layer].shape == (info["seq_len"], heads, 2)
                assert torch.equal(keys[layer], ref_k)
                assert torch.equal(values[layer], ref_v)
                # and it is the data that was scattered in
                assert torch.equal(keys[layer], entries[rid][0][layer])
                assert torch.equal(values[layer], entries[rid][1][layer])


def test_extra_block_ids_are_ignored_and_output_is_a_copy() -> None:
    entries = {"r": full_kv("r", num_layers=1, seq_len=5, num_heads=3, head_dim=2)}
    caches, finished = build_paged_caches(entries, block_size=BLOCK, spare_blocks=2)
    ids = finished["r"]["block_ids"]
    spare = next(b for b in range(caches[0].shape[1]) if b not in ids)
    paged = normalize_caches(caches, BLOCK)
    keys, _ = paged.gather([*ids, spare], 5)
    assert torch.equal(keys[0], entries["r"][0][0])
    caches[0].zero_()
    assert torch.equal(keys[0], entries["r"][0][0])  # not a view over the cache


def test_ambiguous_layout_needs_explicit_choice() -> None:
    entries = {"r": full_kv("r", num_layers=1, seq_len=6, num_heads=BLOCK, head_dim=2)}
    for layout in ("nhd", "hnd"):
        caches, finished = build_paged_caches(entries, block_size=BLOCK, layout=layout)  # type: ignore[arg-type]
        with pytest.raises(KVLayoutError, match="layout='nhd'"):
            normalize_caches(caches, BLOCK)
        keys, _ = normalize_caches(caches, BLOCK, layout).gather(finished["r"]["block_ids"], 6)
        assert torch.equal(keys[0], entries["r"][0][0])


@pytest.mark.parametrize(
    ("caches", "match"),
    [
        ([torch.zeros(3, 5, BLOCK, 2, 2)], "5 dims"),
        ([torch.zeros(2, 5, BLOCK, 2)], "5 dims"),
        ([torch.zeros(2, 5, 3, 3, 2)], "block_size"),
        ([(torch.zeros(5, BLOCK, 2, 2), torch.zeros(5, BLOCK, 3, 2))], "equal shape"),
        ([None, None], "no layer"),
        ([], "no layer"),
        ({"key_cache": [torch.zeros(5, BLOCK, 2, 2)], "value_cache": []}, "equal length"),
        ("not caches", "unsupported"),
        ([42], "unsupported"),
    ],
)
def test_bad_caches_rejected(caches: object, match: str) -> None:
    with pytest.raises(KVLayoutError, match=match):
        normalize_caches(caches, BLOCK)


def test_layer_layouts_must_agree() -> None:
    with pytest.raises(KVLayoutError, match="layout='nhd'"):
        normalize_caches([torch.zeros(2, 5, BLOCK, 3, 2), torch.zeros(2, 5, 3, BLOCK, 2)], BLOCK)


def test_bad_block_size_and_layout_name() -> None:
    caches = [torch.zeros(2, 5, BLOCK, 3, 2)]
    with pytest.raises(KVLayoutError, match="block_size"):
        normalize_caches(caches, 0)
    with pytest.raises(KVLayoutError, match="layout must be"):
        normalize_caches(caches, BLOCK, "nchw")


@pytest.mark.parametrize(
    ("block_ids", "seq_len", "match"),
    [
        ([0], 5, "needs 2 blocks"),
        ([0, 9], 5, "out of range"),
        ([0, -1], 5, "out of range"),
        ([0, 1], 0, "positive"),
        ([0, 1.5], 5, "must be an int"),
        ([0, True], 5, "must be an int"),
        ([0, 1], "5", "must be an int"),
        ([0, 1], 5.0, "must be an int"),
        ("01", 5, "sequence"),
    ],
)
def test_bad_request_rejected(block_ids: list, seq_len: object, match: str) -> None:
    paged = normalize_caches([torch.zeros(2, 5, BLOCK, 3, 2)], BLOCK)
    with pytest.raises(KVPayloadError, match=match):
        paged.gather(block_ids, seq_len)  # type: ignore[arg-type]


def test_block_ids_and_seq_len_as_tensor_or_numpy() -> None:
    entries = {"r": full_kv("r", num_layers=1, seq_len=7, num_heads=3, head_dim=2)}
    caches, finished = build_paged_caches(entries, block_size=BLOCK)
    paged = normalize_caches(caches, BLOCK)
    ids = finished["r"]["block_ids"]
    for block_ids, seq_len in ((torch.tensor(ids), torch.tensor(7)), (np.array(ids), np.int64(7))):
        keys, _ = paged.gather(block_ids, seq_len)  # type: ignore[arg-type]
        assert torch.equal(keys[0], entries["r"][0][0])
