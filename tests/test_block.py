"""Blocks: records as columns, and back, exactly."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.block import Block, Sentinel, blocks_from_records
from zephon_torch.block_columns import Ragged
from zephon_torch.block_views import BlockBatch
from zephon_torch.types import (
    ContributorRef,
    SampleBatch,
    SampleCursor,
    SampleMeta,
    SampleRecord,
)
from zephon_torch.vocab import (
    CONTRIBUTORS_TAG,
    PACKING_METADATA_TAG,
    TOMBSTONE_REASON_TAG,
    TOMBSTONE_TAG,
    close_count,
    closed_offsets,
)

small = st.integers(min_value=0, max_value=50)
lineages = st.lists(st.integers(min_value=0, max_value=5), max_size=3).map(tuple)
sample_ids = st.tuples(small, small, small)


@st.composite
def cursors(draw: st.DrawFn) -> SampleCursor:
    return SampleCursor(draw(small), draw(small), draw(sample_ids), draw(lineages))


@st.composite
def tag_sets(draw: st.DrawFn) -> dict | None:
    kind = draw(st.sampled_from(["none", "none", "tomb", "packed", "packed_tomb", "extra",
                                 "odd"]))
    if kind == "none":
        return None
    tags: dict = {}
    if kind in ("packed", "packed_tomb"):
        refs = draw(st.lists(st.builds(ContributorRef, cursors(), st.booleans()),
                             min_size=1, max_size=4))
        tags[CONTRIBUTORS_TAG] = tuple(refs)
        tags[PACKING_METADATA_TAG] = {"padding_length": draw(small), "num_segments": 2}
    if kind in ("tomb", "packed_tomb"):
        tags[TOMBSTONE_TAG] = True
        tags[TOMBSTONE_REASON_TAG] = draw(st.sampled_from(["filter", "empty", "decode_error"]))
        if draw(st.booleans()):
            tags["_tombstone_detail"] = "bad"
    if kind == "extra":
        tags["user"] = draw(small)
    if kind == "odd":  # reserved keys with unusual values survive as they are
        tags[TOMBSTONE_TAG] = False
        tags[CONTRIBUTORS_TAG] = ()
    return tags


payloads = st.one_of(
    st.none(),
    st.binary(max_size=8),
    st.fixed_dictionaries({"text": st.text(max_size=5)}),
    st.lists(st.integers(-5, 5), max_size=6).map(lambda v: np.array(v, dtype=np.int32)),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, 9), max_size=6)
                           .map(lambda v: np.array(v, dtype=np.int64))}),
)
count_sets = st.one_of(
    st.integers(0, 3).map(lambda c: {c: 1}),
    st.just({}),
    st.dictionaries(st.integers(0, 3), st.integers(1, 4), max_size=3),
)


@st.composite
def record_lists(draw: st.DrawFn, lane: int = 2) -> list[SampleRecord]:
    n = draw(st.integers(0, 12))
    out = []
    for _ in range(n):
        meta = SampleMeta(draw(sample_ids), lane, draw(small), draw(small), draw(count_sets),
                          draw(st.one_of(st.none(), count_sets)), draw(lineages),
                          draw(tag_sets()))
        out.append(SampleRecord(meta, draw(payloads)))
    return out


@settings(max_examples=300, deadline=None)
@given(record_lists())
def test_records_round_trip_through_a_block_exactly(records: list[SampleRecord]) -> None:
    block = Block.from_records(records, lane=2)
    assert len(block) == len(records)
    back = block.records()
    assert back == records
    for mine, theirs in zip(back, records):
        assert mine.meta.tags == theirs.meta.tags
        assert mine.meta.component_token_counts == theirs.meta.component_token_counts
    assert pickle.loads(pickle.dumps(block)).records() == records


@settings(max_examples=200, deadline=None)
@given(record_lists(), st.data())
def test_slices_takes_and_concats_agree_with_the_records(records: list[SampleRecord],
                                                         data: st.DataObject) -> None:
    block = Block.from_records(records, lane=2)
    n = len(records)
    cut = data.draw(st.integers(0, n))
    head, tail = block.split_at(cut)
    assert head.records() == records[:cut]
    assert tail.records() == records[cut:]
    assert Block.concat([head, tail]).records() == records
    index = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n)) if n else []
    assert block.take(index).records() == [records[i] for i in index]


@settings(max_examples=200, deadline=None)
@given(record_lists())
def test_a_block_closes_what_its_records_close(records: list[SampleRecord]) -> None:
    block = Block.from_records(records, lane=2)
    assert block.close_counts().tolist() == [close_count(r.meta) for r in records]
    chunks, offsets = block.closed_offsets()
    mine = sorted(zip(chunks.tolist(), offsets.tolist()))
    theirs = sorted(o for r in records for o in closed_offsets(r.meta))
    assert mine == theirs


def test_field_columns_make_dict_payloads_in_key_order() -> None:
    ids = np.array([[0, 0, i, 5, i] for i in range(3)], dtype=np.int64)
    tokens = Ragged.from_rows([[1, 2], [], [3, 4, 5]], dtype=np.int32)
    block = Block(1, ids, fields={"text": ["a", "", "b"], "input_ids": tokens},
                  component=np.zeros(3, dtype=np.int64))
    block = block.with_tombstones(np.array([False, True, False]), "empty")
    records = block.records()
    assert records[0] == SampleRecord(SampleMeta((0, 0, 0), 1, 5, 0, {0: 1}),
                                      {"text": "a", "input_ids": np.array([1, 2], np.int32)})
    assert list(records[0].payload) == ["text", "input_ids"]
    assert records[1].meta.tombstone and records[1].payload is None
    assert records[1].meta.tags[TOMBSTONE_REASON_TAG] == "empty"
    # A block rebuilt from those records views the same records.
    assert Block.from_records(records).records() == records


def test_ragged_take_and_concat_keep_rows() -> None:
    col = Ragged.from_rows([[1], [2, 3], [], [4, 5, 6]], dtype=np.int32)
    assert [r.tolist() for r in col.take(np.array([3, 0, 2]))] == [[4, 5, 6], [1], []]
    parts = [col.slice(0, 2), col.slice(2, 4)]
    assert Ragged.concat(parts) == col
    assert col.lengths().tolist() == [1, 2, 0, 3]


def test_a_block_of_several_lanes_is_refused_and_split_by_lane() -> None:
    recs = [SampleRecord(SampleMeta((0, 0, i), i % 2, 0, i, {0: 1}), {"text": "x"})
            for i in range(4)]
    with pytest.raises(ValueError, match="one lane"):
        Block.from_records(recs)
    blocks = blocks_from_records(recs)
    assert [b.lane for b in blocks] == [0, 1]
    assert [r for b in blocks for r in b.records()] == [recs[0], recs[2], recs[1], recs[3]]


def test_a_flush_sentinel_is_not_a_block_row() -> None:
    with pytest.raises(ValueError, match="Sentinel"):
        Block.from_records([Sentinel(0, 8).record()])


def test_a_block_batch_is_a_sample_batch_built_on_demand() -> None:
    recs = [SampleRecord(SampleMeta((0, 0, i), 3, 1, i, {0: 1}), {"input_ids": np.arange(4)})
            for i in range(5)]
    batch = BlockBatch(Block.from_records(recs))
    assert isinstance(batch, SampleBatch)
    assert len(batch) == 5
    assert batch.ids == tuple((0, 0, i) for i in range(5))
    assert batch == SampleBatch(recs)
    assert batch.lane_ids == (3,) * 5 and batch.chunk_ids == (1,) * 5
    assert list(batch) == recs
    assert pickle.loads(pickle.dumps(batch)) == SampleBatch(recs)


def test_a_block_batch_trains_exactly_as_its_records() -> None:
    import torch

    rows = []
    for i in range(4):
        pad = i
        tokens = np.arange(10, dtype=np.int32) + i
        tokens[10 - pad:] = 0
        positions = np.concatenate([np.arange(4), np.arange(6 - pad), np.arange(pad)]).astype(
            np.int32)
        refs = (ContributorRef(SampleCursor(i, 0, (0, 0, i)), True),
                ContributorRef(SampleCursor(i, 1, (0, 0, i + 10), (0,)), False))
        meta = SampleMeta((0, 0, i), 1, i, 0, {0: 1}, {0: 10 - pad}, (0,),
                          {CONTRIBUTORS_TAG: refs, PACKING_METADATA_TAG: {"padding_length": pad}})
        rows.append(SampleRecord(meta, {"input_ids": tokens, "positions": positions}))
    plain = SampleBatch(rows)
    viewed = BlockBatch(Block.from_records(rows))
    for kwargs in ({}, {"return_labels": True, "return_cu_seqlens": True,
                        "return_padding_mask": True, "return_num_valid_tokens": True}):
        mine, theirs = viewed.to_training(**kwargs), plain.to_training(**kwargs)
        assert mine.keys() == theirs.keys()
        for key in mine:
            if isinstance(mine[key], torch.Tensor):
                assert torch.equal(mine[key], theirs[key]), key
            else:
                assert mine[key] == theirs[key], key


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_to_training_from_columns_equals_the_general_path(data: st.DataObject) -> None:
    import torch

    rows = data.draw(st.integers(1, 5))
    width = data.draw(st.integers(2, 12))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    tokens = rng.integers(0, 6, size=(rows, width)).astype(
        data.draw(st.sampled_from([np.int32, np.int64, np.uint16])))
    pads = [int(rng.integers(0, width + 1)) for _ in range(rows)]
    positions = np.zeros((rows, width), dtype=np.int32)
    for i in range(rows):
        cuts = sorted(set(rng.integers(1, width, size=2).tolist()) | {0})
        bounds = [*cuts, width]
        for a, b in itertools.pairwise(bounds):
            positions[i, a:b] = np.arange(b - a)
    ids = np.array([[0, 1, i, 2, i] for i in range(rows)], dtype=np.int64)
    block = Block(2, ids, fields={"input_ids": tokens, "positions": positions},
                  counts=[{0: 1}] * rows,
                  packing=[{"padding_length": p} for p in pads])
    kwargs = {
        "return_labels": data.draw(st.booleans()),
        "dtype": data.draw(st.sampled_from(["auto", np.int64, torch.int32])),
        "position_mode": data.draw(st.sampled_from(["preserve", "sequence"])),
        "return_cu_seqlens": data.draw(st.booleans()),
        "return_padding_mask": data.draw(st.booleans()),
        "ignore_index": data.draw(st.sampled_from([-100, -1])),
    }
    if kwargs["return_labels"]:
        kwargs["return_num_valid_tokens"] = data.draw(st.booleans())
        kwargs["return_loss_mask"] = data.draw(st.booleans())
        if data.draw(st.booleans()):
            kwargs.update(eos_mask_loss=True, eos_token_id=int(rng.integers(0, 6)))
    fast = BlockBatch(block).to_training(**kwargs)
    general = SampleBatch(block.records()).to_training(**kwargs)
    assert fast.keys() == general.keys()
    for key in fast:
        mine, theirs = fast[key], general[key]
        if isinstance(mine, torch.Tensor):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), key
        elif isinstance(mine, np.ndarray):
            assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), key
        else:
            assert mine == theirs, key


def test_a_batch_of_packed_rows_is_read_from_its_columns(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    import zephon_torch._training as training

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the general, per-record path ran")

    monkeypatch.setattr(training, "_Gathered", refuse)
    tokens = np.arange(24, dtype=np.int32).reshape(3, 8)
    positions = np.tile(np.arange(8, dtype=np.int32), (3, 1))
    block = Block(0, np.zeros((3, 5), dtype=np.int64),
                  fields={"input_ids": tokens, "positions": positions},
                  component=np.zeros(3, dtype=np.int64),
                  packing=[{"padding_length": 0}, {"padding_length": 2}, {"padding_length": 8}])
    out = BlockBatch(block).to_training(return_labels=True, return_cu_seqlens=True)
    assert out["labels"][1].tolist() == [9, 10, 11, 12, 13, -100, -100]
    assert out["labels"][2].tolist() == [-100] * 7


@settings(max_examples=100, deadline=None)
@given(st.lists(record_lists(), min_size=1, max_size=4), st.data(), st.booleans())
def test_gather_takes_rows_of_several_blocks_in_the_order_asked(
        pools: list[list[SampleRecord]], data: st.DataObject, as_columns: bool) -> None:
    pools = [p for p in pools if p] or [[SampleRecord(SampleMeta((0, 0, 0), 2, 0, 0), None)]]
    blocks = [Block.from_records(p, lane=2) for p in pools]
    if as_columns:  # packed rows: every payload an array column of one layout
        blocks = [b.with_fields({"input_ids": np.arange(len(b) * 3, dtype=np.int32)
                                 .reshape(len(b), 3)}) for b in blocks]
    picks = data.draw(st.lists(st.tuples(st.integers(0, len(blocks) - 1), st.integers(0, 99)),
                               min_size=1, max_size=20))
    picks = [(b, r % len(blocks[b])) for b, r in picks]
    got = Block.gather(blocks, [b for b, _ in picks], [r for _, r in picks]).records()
    assert got == [blocks[b].records()[r] for b, r in picks]
