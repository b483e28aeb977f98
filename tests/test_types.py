"""Tests for the data model in ``zephon_torch.types`` (everything but ``to_training``)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.types import (
    CONTRIBUTORS_TAG,
    FLUSH_SENTINEL_TAG,
    PACKING_METADATA_TAG,
    TOMBSTONE_TAG,
    ContributorRef,
    SampleBatch,
    SampleCursor,
    SampleMeta,
    SampleRecord,
)


def _meta(i: int = 0, *, lane: int = 0, chunk: int = 3, offset: int = 7, lineage=(), tags=None):
    return SampleMeta(
        sample_id=(1, 2, i), lane_id=lane, chunk_id=chunk, chunk_offset=offset,
        lineage=tuple(lineage), tags={} if tags is None else tags,
    )


# --------------------------------------------------------------------------- constants


def test_reserved_tag_key_constants():
    assert CONTRIBUTORS_TAG == "_contributors"
    assert TOMBSTONE_TAG == "_tombstone"
    assert FLUSH_SENTINEL_TAG == "_flush_sentinel"
    assert PACKING_METADATA_TAG == "_packing_metadata"


# --------------------------------------------------------------------------- SampleCursor


def test_cursor_as_key_layout():
    cursor = SampleCursor(3, 7, (1, 2, 9), (0, 4))
    assert cursor.as_key() == (3, 7, (0, 4), (1, 2, 9))
    assert SampleCursor(3, 7, (1, 2, 9)).lineage == ()
    assert SampleCursor(3, 7, (1, 2, 9)).as_key() == (3, 7, (), (1, 2, 9))


def test_cursor_from_key_round_trip():
    cursor = SampleCursor(3, 7, (1, 2, 9), (0, 4))
    back = SampleCursor.from_key(cursor.as_key())
    assert back == cursor
    assert back.as_key() == (3, 7, (0, 4), (1, 2, 9))


def test_cursor_from_key_json_round_trip_restores_tuples():
    cursor = SampleCursor(3, 7, (1, 2, 9), (0, 4))
    decoded = json.loads(json.dumps(cursor.as_key()))
    assert decoded == [3, 7, [0, 4], [1, 2, 9]]
    back = SampleCursor.from_key(decoded)
    assert back == cursor
    assert type(back.lineage) is tuple
    assert type(back.sample_id) is tuple
    assert back.lineage == (0, 4)
    assert back.sample_id == (1, 2, 9)
    assert back.as_key() == cursor.as_key()
    assert hash(back) == hash(cursor)


def test_cursor_child_appends_lineage():
    cursor = SampleCursor(3, 7, (1, 2, 9))
    child = cursor.child(2)
    assert child.lineage == (2,)
    assert child.child(5).lineage == (2, 5)
    assert (child.chunk_id, child.chunk_offset, child.sample_id) == (3, 7, (1, 2, 9))
    assert cursor.lineage == ()  # the parent is untouched


def test_cursor_base_offset():
    assert SampleCursor(3, 7, (1, 2, 9), (0, 4)).base_offset == (3, 7)
    assert SampleCursor(0, 0, (0, 0, 0)).base_offset == (0, 0)


def test_cursor_order_matches_single_threaded_emission():
    sid = (0, 0, 5)
    doc = SampleCursor(3, 7, sid)
    first, second = doc.child(0), doc.child(1)
    grandchild = first.child(0)
    nxt = SampleCursor(3, 8, (0, 0, 1))
    next_chunk = SampleCursor(4, 0, (0, 0, 0))
    shuffled = [next_chunk, second, nxt, grandchild, doc, first]
    assert sorted(shuffled) == [doc, first, grandchild, second, nxt, next_chunk]
    assert doc < first < second < nxt < next_chunk
    assert next_chunk > nxt >= nxt
    assert doc <= doc


def test_cursor_lineage_sorts_before_sample_id():
    big_sid_small_lineage = SampleCursor(0, 0, (9, 9, 9), (0,))
    small_sid_big_lineage = SampleCursor(0, 0, (0, 0, 0), (1,))
    assert big_sid_small_lineage < small_sid_big_lineage
    assert not small_sid_big_lineage < big_sid_small_lineage
    # Same lineage: the sample id decides.
    assert SampleCursor(0, 0, (0, 0, 1), (1,)) < SampleCursor(0, 0, (0, 0, 2), (1,))


def test_cursor_equality_and_hash_follow_key():
    a = SampleCursor(1, 2, (3, 4, 5), (6,))
    b = SampleCursor(1, 2, (3, 4, 5), (6,))
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != SampleCursor(1, 2, (3, 4, 5), (7,))


_sample_ids = st.tuples(*(st.integers(0, 5) for _ in range(3)))
_cursors = st.builds(
    SampleCursor,
    st.integers(0, 5),
    st.integers(0, 5),
    _sample_ids,
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
)


@settings(max_examples=100, deadline=None)
@given(cursors=st.lists(_cursors, max_size=12))
def test_cursor_key_round_trip_and_ordering_property(cursors):
    for cursor in cursors:
        assert SampleCursor.from_key(cursor.as_key()) == cursor
        assert SampleCursor.from_key(json.loads(json.dumps(cursor.as_key()))) == cursor
    assert [c.as_key() for c in sorted(cursors)] == sorted(c.as_key() for c in cursors)
    for a in cursors[:4]:
        for b in cursors[:4]:
            assert (a < b) == (a.as_key() < b.as_key())
            assert (a == b) == (a.as_key() == b.as_key())


# --------------------------------------------------------------------------- SampleMeta


def test_meta_defaults():
    meta = SampleMeta(sample_id=(0, 1, 2), lane_id=4, chunk_id=5)
    assert meta.chunk_offset == 0
    assert meta.component_sample_counts == {}
    assert meta.component_token_counts is None
    assert meta.lineage == ()
    assert meta.tags == {}
    assert ContributorRef(SampleCursor(0, 0, (0, 0, 0))).is_last_child is True


def test_meta_child_appends_lineage_and_keeps_the_rest():
    meta = SampleMeta((1, 2, 3), lane_id=4, chunk_id=5, chunk_offset=6,
                      component_sample_counts={0: 1}, component_token_counts={0: 10},
                      tags={"k": "v"})
    child = meta.child(2)
    assert child.lineage == (2,)
    assert child.child(5).lineage == (2, 5)
    assert child.sample_id == (1, 2, 3)
    assert child.lane_id == 4
    assert child.chunk_id == 5
    assert child.chunk_offset == 6
    assert child.component_sample_counts == {0: 1}
    assert child.component_token_counts == {0: 10}
    assert child.tags == {"k": "v"}
    assert meta.lineage == ()


def test_meta_with_lineage_replaces_path():
    meta = _meta(lineage=(9, 9))
    replaced = meta.with_lineage([1, 2])
    assert replaced.lineage == (1, 2)
    assert type(replaced.lineage) is tuple
    assert meta.lineage == (9, 9)
    assert meta.with_lineage(()).lineage == ()


def test_meta_cursor_and_cursor_key():
    meta = _meta(4, chunk=3, offset=7, lineage=(0, 1))
    assert meta.cursor == SampleCursor(3, 7, (1, 2, 4), (0, 1))
    assert meta.as_cursor_key() == (3, 7, (0, 1), (1, 2, 4))
    assert meta.as_cursor_key() == meta.cursor.as_key()
    assert meta.child(3).cursor == meta.cursor.child(3)


def test_meta_contribution_refs_default_to_own_cursor():
    meta = _meta(4, lineage=(2,))
    assert meta.contributors == ()
    assert meta.contribution_refs() == (ContributorRef(meta.cursor, True),)
    assert meta.contribution_refs()[0].is_last_child is True
    assert meta.contribution_cursors() == (meta.cursor,)


def test_meta_with_contributors_sets_and_clears():
    meta = _meta(0)
    refs = [
        ContributorRef(SampleCursor(1, 0, (0, 0, 1), (0,)), False),
        ContributorRef(SampleCursor(1, 1, (0, 0, 2)), True),
    ]
    packed = meta.with_contributors(refs)
    assert packed.contributors == tuple(refs)
    assert packed.tags[CONTRIBUTORS_TAG] == tuple(refs)
    assert packed.contribution_refs() == tuple(refs)
    assert packed.contribution_cursors() == (refs[0].cursor, refs[1].cursor)
    assert meta.tags == {}  # original untouched
    assert meta.contributors == ()

    cleared = packed.with_contributors(None)
    assert CONTRIBUTORS_TAG not in cleared.tags
    assert cleared.contributors == ()
    assert cleared.contribution_refs() == (ContributorRef(cleared.cursor, True),)
    assert packed.contributors == tuple(refs)
    assert CONTRIBUTORS_TAG not in packed.with_contributors([]).tags


def test_meta_tombstone():
    meta = _meta(0, tags={"other": 1})
    assert meta.tombstone is False
    assert meta.is_sentinel is False
    dead = meta.with_tombstone()
    assert dead.tombstone is True
    assert dead.is_sentinel is True
    assert dead.is_flush_sentinel is False
    assert dead.tags == {"other": 1, TOMBSTONE_TAG: True}
    assert meta.tags == {"other": 1}
    alive = dead.with_tombstone(False)
    assert alive.tombstone is False
    assert alive.is_sentinel is False
    assert alive.tags == {"other": 1}


def test_meta_flush_sentinel():
    meta = _meta(0, tags={FLUSH_SENTINEL_TAG: True})
    assert meta.is_flush_sentinel is True
    assert meta.is_sentinel is True
    assert meta.tombstone is False
    plain = _meta(0)
    assert plain.is_flush_sentinel is False
    assert plain.is_sentinel is False
    assert _meta(0, tags={"_flush_sentinel": False}).is_flush_sentinel is False


def test_meta_padding_length():
    assert _meta(0).padding_length is None
    assert _meta(0, tags={PACKING_METADATA_TAG: {}}).padding_length is None
    assert _meta(0, tags={"_packing_metadata": {"padding_length": 3}}).padding_length == 3
    assert _meta(0, tags={"_packing_metadata": {"padding_length": 0}}).padding_length == 0
    value = _meta(0, tags={"_packing_metadata": {"padding_length": np.int64(5)}}).padding_length
    assert value == 5
    assert type(value) is int


@pytest.mark.parametrize(
    ("obj", "attr", "value"),
    [
        (SampleCursor(0, 0, (0, 0, 0)), "chunk_id", 1),
        (ContributorRef(SampleCursor(0, 0, (0, 0, 0))), "is_last_child", False),
        (SampleMeta((0, 0, 0), 0, 0), "lineage", (1,)),
        (SampleMeta((0, 0, 0), 0, 0), "tags", {}),
        (SampleRecord(SampleMeta((0, 0, 0), 0, 0), {"x": 1}), "payload", {}),
        (SampleBatch([]), "records", ()),
    ],
)
def test_frozen(obj, attr, value):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, attr, value)


# --------------------------------------------------------------------------- SampleRecord


def test_record_equality_compares_numpy_payloads_by_value():
    a = SampleRecord(_meta(0), np.array([1, 2, 3], dtype=np.int32))
    b = SampleRecord(_meta(0), np.array([1, 2, 3], dtype=np.int32))
    c = SampleRecord(_meta(0), np.array([1, 2, 4], dtype=np.int32))
    assert a == b
    assert a != c
    assert SampleRecord(_meta(1), np.array([1, 2, 3], dtype=np.int32)) != a

    d1 = SampleRecord(_meta(0), {"input_ids": np.arange(4), "text": "t"})
    d2 = SampleRecord(_meta(0), {"input_ids": np.arange(4), "text": "t"})
    d3 = SampleRecord(_meta(0), {"input_ids": np.arange(1, 5), "text": "t"})
    d4 = SampleRecord(_meta(0), {"input_ids": np.arange(4), "text": "u"})
    assert d1 == d2
    assert d1 != d3
    assert d1 != d4
    assert hash(d1) == hash(d2)


# --------------------------------------------------------------------------- SampleBatch


def test_batch_stores_tuple_and_derives_fields():
    records = [
        SampleRecord(SampleMeta((0, 0, 0), lane_id=2, chunk_id=5), {"x": 0}),
        SampleRecord(SampleMeta((0, 1, 7), lane_id=2, chunk_id=6, lineage=(1, 0)), {"x": 1}),
    ]
    batch = SampleBatch(records)
    assert type(batch.records) is tuple
    assert batch.records == tuple(records)
    assert len(batch) == 2
    assert list(batch) == records
    assert batch[1] is records[1]
    assert batch.lane_ids == (2, 2)
    assert batch.chunk_ids == (5, 6)
    assert batch.ids == ((0, 0, 0), (0, 1, 7))
    assert batch.lineage_paths == ((), (1, 0))


def test_batch_from_generator_and_empty():
    records = [SampleRecord(SampleMeta((0, 0, i), 0, 0), {"x": i}) for i in range(3)]
    batch = SampleBatch(r for r in records)
    assert batch.records == tuple(records)
    empty = SampleBatch([])
    assert len(empty) == 0
    assert list(empty) == []
    assert empty.records == ()
    assert empty.lane_ids == ()
    assert empty.chunk_ids == ()
    assert empty.ids == ()
    assert empty.lineage_paths == ()


def test_batch_equality_by_record_value():
    a = SampleBatch([SampleRecord(_meta(0), {"input_ids": np.array([1, 2])})])
    b = SampleBatch([SampleRecord(_meta(0), {"input_ids": np.array([1, 2])})])
    c = SampleBatch([SampleRecord(_meta(0), {"input_ids": np.array([1, 3])})])
    assert a == b
    assert a != c


# --------------------------------------------------------------------------- many at once

_rows = st.lists(st.tuples(*[st.integers(0, 2**40)] * 5), max_size=8)


@settings(max_examples=200, deadline=None)
@given(rows=_rows, data=st.data())
def test_records_built_in_one_sweep_are_those_the_constructors_build(rows, data):
    import pickle

    from zephon_torch.types import metas_from_columns, records_from_columns

    n = len(rows)
    counts = data.draw(st.lists(st.one_of(st.none(), st.just({0: 1}), st.dictionaries(
        st.integers(0, 3), st.integers(1, 4), max_size=2)), min_size=n, max_size=n))
    tokens = data.draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.just({1: 7})),
                                                     min_size=n, max_size=n)))
    lineage = data.draw(st.one_of(st.none(), st.lists(
        st.lists(st.integers(0, 3), max_size=2).map(tuple), min_size=n, max_size=n)))
    tags = data.draw(st.one_of(st.none(), st.lists(
        st.one_of(st.none(), st.just({TOMBSTONE_TAG: True})), min_size=n, max_size=n)))
    payloads = [{"i": i} for i in range(n)]
    lane = data.draw(st.integers(0, 7))
    columns = [[row[k] for row in rows] for k in range(5)]
    lanes = [lane] * n
    records = records_from_columns(lanes, columns, counts, payloads, tokens, lineage, tags)
    metas = metas_from_columns(lanes, columns, counts, tokens, lineage, tags)
    for i, ((d, s, loc, c, o), record, meta) in enumerate(zip(rows, records, metas)):
        expected = SampleMeta((d, s, loc), lane, c, o, counts[i],
                              None if tokens is None else tokens[i],
                              () if lineage is None else lineage[i],
                              None if tags is None else tags[i])
        assert type(record) is SampleRecord and type(meta) is SampleMeta
        assert type(record.meta) is SampleMeta
        assert record.payload is payloads[i]
        for got in (record.meta, meta):
            assert got == expected and hash(got) == hash(expected)
            for name in SampleMeta.__slots__:
                assert getattr(got, name) == getattr(expected, name), name
            assert type(got.tags) is type(expected.tags)  # the shared empty tags included
            assert pickle.loads(pickle.dumps(got)) == expected
            with pytest.raises(dataclasses.FrozenInstanceError):
                got.lane_id = lane + 1  # type: ignore[misc]
        assert record == SampleRecord(expected, payloads[i])
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.payload = None  # type: ignore[misc]


def test_the_drafts_have_the_layout_of_the_types_they_become():
    from zephon_torch._types_records import _MetaDraft, _RecordDraft

    assert _MetaDraft.__slots__ == SampleMeta.__slots__
    assert _RecordDraft.__slots__ == SampleRecord.__slots__
    assert [f.name for f in dataclasses.fields(SampleMeta)] == list(SampleMeta.__slots__)
    assert [f.name for f in dataclasses.fields(SampleRecord)] == list(SampleRecord.__slots__)
