"""The built-in engine's keys and values with room to grow (grail/inference/builtin/batch.py):
a `RoomyLayer` holds what a transformers `DynamicLayer` holds through appends, row selections and
its room running out, and `merge` and `assemble` left-pad rows of batches into one without
changing a value."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from grail.inference.builtin.batch import (
    Batch,
    RoomyLayer,
    assemble,
    kv,
    merge,
    room_for,
    roomy_cache,
)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_a_roomy_layer_holds_what_a_dynamic_layer_holds() -> None:
    keys, values = _randn(4, 2, 5, 8, seed=0), _randn(4, 2, 5, 8, seed=1)
    plain = DynamicLayer()
    plain.update(keys, values)
    room = torch.zeros(4, 2, room_for(5), 8), torch.zeros(4, 2, room_for(5), 8)
    room[0][:, :, :5], room[1][:, :, :5] = keys, values
    roomy = RoomyLayer.over(*room, 5)
    assert torch.equal(roomy.keys, plain.keys)
    rows = 4
    for step in range(60):  # past the first room's end (room_for(5) = 37 positions)
        new = _randn(rows, 2, 1, 8, seed=10 + step), _randn(rows, 2, 1, 8, seed=100 + step)
        expected = plain.update(*new)
        got = roomy.update(*new)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        if step in (10, 40):  # the batch drops a row and reorders the rest
            index = torch.tensor([2, 0, 1][: rows - 1])
            plain.batch_select_indices(index)
            roomy.batch_select_indices(index)
            rows -= 1
            assert torch.equal(roomy.keys, plain.keys)
            assert torch.equal(roomy.values, plain.values)
    assert roomy._room is not None and roomy._room[0].shape[2] > roomy.keys.shape[2]


def _batch(rows: int, width: int, seed: int) -> Batch:
    layers = [
        (_randn(rows, 2, width, 8, seed=seed + i), _randn(rows, 2, width, 8, seed=seed + 9))
        for i in range(2)
    ]
    cache = roomy_cache([RoomyLayer.over(k, v, width) for k, v in layers])
    return Batch(
        rows=[None] * rows,
        cache=cache,
        mask=torch.ones(rows, width, dtype=torch.long),
        pad_starts=[0] * rows,
        next_pos=[width] * rows,
        tokens=[0] * rows,
    )


def test_merge_left_pads_the_shorter_batch_and_keeps_every_value() -> None:
    a, b = _batch(3, 7, seed=0), _batch(2, 4, seed=50)
    merged = merge(a, b)
    assert merged.pad_starts == [0, 0, 0, 3, 3]
    assert merged.mask[3:, :3].sum() == 0 and merged.mask[:3].all() and merged.mask[3:, 3:].all()
    layers = zip(merged.cache.layers, a.cache.layers, b.cache.layers, strict=True)
    for layer, la, lb in layers:
        keys, values = kv(layer)
        assert isinstance(layer, RoomyLayer) and keys.shape == (5, 2, 7, 8)
        assert torch.equal(keys[:3], kv(la)[0]) and torch.equal(values[:3], kv(la)[1])
        assert torch.equal(keys[3:, :, 3:], kv(lb)[0]) and torch.equal(values[3:, :, 3:], kv(lb)[1])
        assert not keys[3:, :, :3].any()  # padding is zeros
        assert layer._room is not None and layer._room[0].shape[2] == room_for(7)


def test_assemble_picks_rows_of_batches_in_any_order_and_keeps_every_value() -> None:
    a, b = _batch(4, 6, seed=0), _batch(3, 9, seed=70)
    a.pad_starts = [0, 2, 0, 3]  # rows 1 and 3 are shorter (left-padded)
    a.next_pos = [6, 4, 6, 3]
    a.tokens, b.tokens = [10, 11, 12, 13], [20, 21, 22]
    # a row repeated, consecutive rows of a batch, rows dropped, the two batches interleaved
    picks = [(b, 2), (a, 1), (a, 1), (a, 1), (b, 0), (b, 1), (a, 3)]
    out = assemble(picks)
    assert out.pad_starts == [0, 5, 5, 5, 0, 0, 6]  # 9 wide: b's rows are the longest
    assert out.next_pos == [9, 4, 4, 4, 9, 9, 3] and out.tokens == [22, 11, 11, 11, 20, 21, 13]
    assert out.mask.tolist() == [[int(j >= p) for j in range(9)] for p in out.pad_starts]
    for layer in range(2):
        for which in range(2):  # keys, values
            got = kv(out.cache.layers[layer])[which]
            assert got.shape == (7, 2, 9, 8)
            for r, (src, row) in enumerate(picks):
                length = src.mask.shape[1] - src.pad_starts[row]
                expected = kv(src.cache.layers[layer])[which][row, :, -length:]
                assert torch.equal(got[r, :, 9 - length :], expected)
                assert not got[r, :, : 9 - length].any()  # padding is zeros
        roomy = out.cache.layers[layer]
        assert isinstance(roomy, RoomyLayer) and roomy._room is not None
        assert roomy._room[0].shape[2] == room_for(9)
