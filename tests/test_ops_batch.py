"""Tests for ``zephon_torch.ops.batch``: per-lane batches and the chunk-aware epoch reset."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from contract_registry import ContractData, cases_for, check_case
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.ops.accumulators import BatchingAccumulator
from zephon_torch.ops.base import OpContext, tombstone
from zephon_torch.ops.batch import Batch
from zephon_torch.types import FLUSH_SENTINEL_TAG, SampleBatch, SampleMeta, SampleRecord


def _rec(i: int, *, lane: int = 0, chunk: int = 0, n: int = 4) -> SampleRecord:
    meta = SampleMeta((0, lane, i), lane_id=lane, chunk_id=chunk, chunk_offset=i,
                      component_sample_counts={0: 1})
    return SampleRecord(meta, {"input_ids": np.arange(n, dtype=np.int32)})


def _acc(op: Batch) -> BatchingAccumulator:
    acc = op.accumulator(deterministic=True, ctx=OpContext())
    assert isinstance(acc, BatchingAccumulator)
    return acc


def _batches(op: Batch, acc: BatchingAccumulator, micro_batches) -> list[SampleBatch]:
    return [b for mb in micro_batches for b in op.process_many(mb)]


def _ids(batch: SampleBatch) -> list[int]:
    return [sid[2] for sid in batch.ids]


# --------------------------------------------------------------------------- shapes


def test_full_batches_then_drop_last_reports_the_remainder():
    op = Batch(4)
    acc = _acc(op)
    records = [_rec(i) for i in range(10)]
    batches = _batches(op, acc, acc.push_many(records))
    assert [_ids(b) for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(isinstance(b, SampleBatch) for b in batches)
    assert acc.flush() == []
    assert acc.take_dropped() == records[8:]
    assert acc.take_dropped() == []  # reported once
    assert not acc.has_pending_data()


def test_without_drop_last_the_partial_batch_is_emitted_at_the_end():
    op = Batch(4, drop_last=False)
    acc = _acc(op)
    acc.push_many([_rec(i) for i in range(6)])
    assert [_ids(b) for b in _batches(op, acc, acc.flush())] == [[4, 5]]
    assert acc.take_dropped() == []


def test_batches_are_per_lane_and_keep_stream_order():
    op = Batch(3)
    acc = _acc(op)
    records = [_rec(i, lane=i % 2) for i in range(12)]
    batches = _batches(op, acc, acc.push_many(records))
    assert [(b.lane_ids[0], _ids(b)) for b in batches] == [
        (0, [0, 2, 4]), (1, [1, 3, 5]), (0, [6, 8, 10]), (1, [7, 9, 11])
    ]
    assert all(len(set(b.lane_ids)) == 1 for b in batches)


def test_batch_payload_feeds_to_training():
    op = Batch(2)
    acc = _acc(op)
    (batch,) = _batches(op, acc, acc.push_many([_rec(0, n=5), _rec(1, n=5)]))
    out = batch.to_training(dtype=None)
    assert out["input_ids"] == [[0, 1, 2, 3, 4]] * 2
    assert out["ids"] == [(0, 0, 0), (0, 0, 1)]


@settings(max_examples=60, deadline=None)
@given(
    lanes=st.lists(st.integers(0, 2), max_size=50),
    size=st.integers(1, 7),
    drop_last=st.booleans(),
    cuts=st.lists(st.integers(0, 50), max_size=6),
)
def test_every_record_is_batched_or_dropped_exactly_once(lanes, size, drop_last, cuts):
    records = [_rec(i, lane=lane) for i, lane in enumerate(lanes)]
    bounds = [0, *sorted(c % (len(records) + 1) for c in cuts), len(records)]
    op = Batch(size, drop_last=drop_last)
    acc = _acc(op)
    batches: list[SampleBatch] = []
    for a, b in itertools.pairwise(bounds):
        batches += _batches(op, acc, acc.push_many(records[a:b]))
    batches += _batches(op, acc, acc.flush())
    dropped = acc.take_dropped()
    for lane in set(lanes):
        mine = [i for b in batches if b.lane_ids[0] == lane for i in _ids(b)]
        lost = [r.meta.sample_id[2] for r in dropped if r.meta.lane_id == lane]
        assert mine + lost == [i for i, la in enumerate(lanes) if la == lane]
        full, rest = divmod(lanes.count(lane), size)
        sizes = [len(b) for b in batches if b.lane_ids[0] == lane]
        assert sizes == [size] * full + ([rest] if rest and not drop_last else [])
        assert len(lost) == (rest if drop_last else 0)


# --------------------------------------------------------------------------- sentinels


def test_try_epoch_reset_waits_for_pre_boundary_records_to_leave():
    op = Batch(4)
    acc = _acc(op)
    boundary = 2
    # Lane 0 holds two records of chunk 1 when its sentinel for chunk 2 arrives.
    acc.push_many([_rec(0, chunk=1), _rec(1, chunk=1)])
    assert acc.try_epoch_reset(boundary, 0) is False
    assert acc.try_epoch_reset(boundary, 1) is True  # other lanes are not blocked
    # Records after the boundary complete the cross-epoch batch [old, old, new, new].
    out = acc.push_many([_rec(2, chunk=2), _rec(3, chunk=2), _rec(4, chunk=2)])
    assert [r.meta.chunk_id for r in out[0]] == [1, 1, 2, 2]
    # Only post-boundary records remain: the sentinel can be released.
    assert acc.has_pending_data(0)
    assert acc.try_epoch_reset(boundary, 0) is True
    assert acc.try_epoch_reset(boundary + 1, 0) is False


def test_try_epoch_reset_on_an_empty_lane_is_true():
    acc = _acc(Batch(4))
    assert acc.try_epoch_reset(0, 0) is True
    acc.push_many([_rec(i, chunk=0) for i in range(4)])
    assert acc.try_epoch_reset(1, 0) is True


def test_reset_flush_without_drop_last_emits_one_lane_only():
    op = Batch(4, drop_last=False)
    acc = _acc(op)
    acc.push_many([_rec(0, lane=0), _rec(1, lane=1), _rec(2, lane=0)])
    out = _batches(op, acc, acc.flush(reset=True, lane_id=0))
    assert [_ids(b) for b in out] == [[0, 2]]
    assert not acc.has_pending_data(0)
    assert acc.has_pending_data(1)
    # Lane 0 now counts from zero, like a fresh accumulator.
    assert acc.push_many([_rec(i, lane=0) for i in range(10, 13)]) == []
    assert len(acc.push_many([_rec(13, lane=0)])[0]) == 4


# --------------------------------------------------------------------------- process_many


def test_process_many_of_nothing_is_nothing():
    assert Batch(2).process_many([]) == []


def test_tombstones_and_sentinels_never_enter_a_batch():
    op = Batch(2)
    with pytest.raises(ValueError, match="tombstone"):
        op.process_many([_rec(0), tombstone(_rec(1), "filter")])
    rec = _rec(2)
    sentinel = SampleRecord(
        SampleMeta(rec.meta.sample_id, 0, 3, tags={FLUSH_SENTINEL_TAG: True}), None
    )
    with pytest.raises(ValueError, match="sentinel"):
        op.process_many([sentinel])


def test_mixed_lanes_and_non_records_are_rejected():
    op = Batch(2)
    with pytest.raises(ValueError, match="mixes lanes 0 and 1"):
        op.process_many([_rec(0, lane=0), _rec(1, lane=1)])
    with pytest.raises(TypeError, match="SampleBatch"):
        op.process_many([SampleBatch([_rec(0)])])


# --------------------------------------------------------------------------- operator surface


def test_batch_size_is_a_parameter_not_a_knob():
    acc = Batch(8).accumulator(deterministic=True, ctx=OpContext(microbatch_size=3))
    assert acc.max_batch == 8
    assert acc.drop_last is True


def test_traits_and_config():
    op = Batch(8, drop_last=False)
    assert op.name == "batch"
    traits = op.traits()
    assert traits.produces_batches is True
    assert traits.preserves_cursor_order is True
    config = op.config()
    assert config["microbatch_size"] == 8 and config["drop_last"] is False
    assert repr(op) == "Batch(microbatch_size=8, drop_last=False)"


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True, None])
def test_bad_microbatch_size_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=f"microbatch_size.*{bad!r}"):
        Batch(bad)


@pytest.mark.parametrize("case", cases_for("zephon_torch.ops.batch"))
def test_batch_keeps_the_operator_contract(
        case: str, contract_data: ContractData) -> None:
    """Every runner, worker count and micro-batch size gives the inline output, each lane
    the same on any number of ranks, every sample is delivered or tombstoned once, and a
    checkpoint after any output resumes exactly (``zephon_torch.testing``)."""
    check_case(case, contract_data)
