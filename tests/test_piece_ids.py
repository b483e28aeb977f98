"""``to_training(return_piece_ids=True)`` names every piece of every row.

``ids`` names one sample per row (a packed row's first piece). With the
opt-in ``piece_ids`` a training loop can check, batch by batch, that an epoch
held every input token exactly once, which used to need ``to_training=False``
and each record's ``contribution_refs()``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

import zephon_torch as zt
from zephon_torch.types import SampleBatch, SampleMeta, SampleRecord

LENGTHS = [3, 17, 5, 1, 12, 9, 30, 2, 8, 8, 4, 21, 6, 1, 11, 7, 13, 3, 9, 16]


def _documents() -> list[np.ndarray]:
    """Documents whose token ids are unique across the corpus (document i: i*1000 + k)."""
    return [np.arange(n, dtype=np.int32) + 1000 * (i + 1) for i, n in enumerate(LENGTHS)]


def _owner(token: int) -> int:
    return token // 1000 - 1


@pytest.mark.parametrize("algorithm", ["first_fit", "wrap", "best_fit_decreasing"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_over_an_epoch_the_pieces_named_cover_every_input_token_exactly_once(algorithm,
                                                                             num_workers):
    docs = _documents()
    pipe = (zt.Pipeline.from_items([{"input_ids": d} for d in docs], num_lanes=4, chunk_size=4)
            .pack_flat(10, algorithm=algorithm).batch(3, drop_last=False))
    loader = zt.DataLoader(pipe, num_workers=num_workers,
                           to_training={"return_piece_ids": True})
    seen: Counter[int] = Counter()
    tokens_of: dict[int, int] = Counter()
    rows = 0
    for batch in loader:
        assert len(batch["piece_ids"]) == len(batch["ids"])
        for row, pieces, first in zip(batch["input_ids"].tolist(), batch["piece_ids"],
                                      batch["ids"]):
            rows += 1
            assert pieces[0][:3] == first  # ids names the first piece
            end = 0
            for dataset, shard, local, start, stop in pieces:
                assert (dataset, shard, start) == (0, 0, end)  # pieces tile the row
                end = stop
                span = row[start:stop]
                assert span and {_owner(t) for t in span} == {local}
                seen.update(span)
                tokens_of[local] += stop - start
            assert all(t == 0 for t in row[end:])  # the rest is padding
    assert rows > len(docs) // 3
    expected = Counter(int(t) for d in docs for t in d)
    assert seen == expected  # every token once: nothing lost, nothing repeated
    assert dict(tokens_of) == dict(enumerate(LENGTHS))


def test_piece_ids_are_off_by_default_and_follow_rename_and_exclude():
    pipe = zt.Pipeline.from_items([{"input_ids": d} for d in _documents()[:4]]
                                  ).pack_flat(32).batch(1, drop_last=False)
    with pipe.iter(runner="inline") as it:
        (batch,) = list(it)
    assert "piece_ids" not in batch.to_training()
    expected = [[(0, 0, 0, 0, 3), (0, 0, 1, 3, 20), (0, 0, 2, 20, 25), (0, 0, 3, 25, 26)]]
    assert batch.to_training(return_piece_ids=True)["piece_ids"] == expected
    assert batch.to_training(return_piece_ids=True, return_labels=True,
                             rename_fields={"piece_ids": "pieces"})["pieces"] == expected
    out = batch.to_training(return_piece_ids=True, exclude_fields=("piece_ids",))
    assert "piece_ids" not in out
    swapped = batch.to_training(return_piece_ids=True,
                                rename_fields={"piece_ids": "ids", "ids": "piece_ids"})
    assert swapped["ids"] == expected and swapped["piece_ids"] == [(0, 0, 0)]


def _record(i: int, payload: Any) -> SampleRecord:
    return SampleRecord(SampleMeta((0, 2, i), 0, 0, i), payload)


def test_an_unpacked_row_is_one_piece_spanning_its_tokens():
    batch = SampleBatch([_record(0, {"input_ids": np.arange(4)}),
                         _record(1, {"input_ids": np.arange(6)})])
    out = batch.to_training(return_piece_ids=True, dtype=None, flatten=True)
    assert out["piece_ids"] == [[(0, 2, 0, 0, 4)], [(0, 2, 1, 0, 6)]]
    assert SampleBatch([]).to_training(return_piece_ids=True)["piece_ids"] == []


def test_a_packed_row_without_positions_cannot_be_cut_into_pieces():
    pipe = zt.Pipeline.from_items([{"input_ids": d} for d in _documents()[:3]]
                                  ).pack_flat(32, emit_positions=False).batch(1, drop_last=False)
    with pipe.iter(runner="inline") as it:
        (batch,) = list(it)
    with pytest.raises(ValueError, match=r"return_piece_ids: record \(0, 0, 0\) holds 3 pieces "
                                         r"but no 'positions'.*emit_positions=True"):
        batch.to_training(return_piece_ids=True)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"return_piece_ids": 1}, r"return_piece_ids must be True or False, got 1"),
    ({"return_piece_ids": True, "format": "hf"},
     r"format='hf' does not take return_piece_ids=True"),
    ({"return_piece_ids": True, "extra_fields": ("piece_ids",)},
     r"extra field 'piece_ids' would overwrite the generated output field 'piece_ids'"),
    ({"return_piece_ids": True, "rename_fields": {"piece_ids": "input_ids"}},
     r"rename_fields produces the output name 'input_ids' twice \(from 'piece_ids'\)"),
])
def test_bad_piece_id_options_are_refused(kwargs, message):
    batch = SampleBatch([_record(0, {"input_ids": np.arange(4), "piece_ids": np.arange(4)})])
    with pytest.raises(ValueError, match=message):
        batch.to_training(**kwargs)
