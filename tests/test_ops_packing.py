"""Tests for ``zephon_torch.ops.packing``: the bin engine, ``PackFlat`` and ``PackSequences``.

The tests drive an operator's accumulator and ``process_many`` directly, the
way a runner does. Document ``i`` of the hand-written examples holds the
tokens ``10*(i+1), 10*(i+1)+1, ...`` so every expected row can be read off.

Every test runs twice: with the compiled placement kernel and with its
pure-Python twin (``ZEPHON_NATIVE=0``), which must behave identically.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from contract_registry import ContractData, cases_for, check_case
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch.ops._binpack import native_available
from zephon_torch.ops.base import TOMBSTONE_REASON_TAG, OpContext, OpTraits, tombstone
from zephon_torch.ops.pack_engine import PackFlatAccumulator, PackingAccumulator
from zephon_torch.ops.pack_options import DEFAULT_BFD_WINDOW
from zephon_torch.ops.pack_rows import assemble_flat_row
from zephon_torch.ops.packing import PackFlat, PackSequences
from zephon_torch.types import (
    PACKING_METADATA_TAG,
    ContributorRef,
    SampleBatch,
    SampleMeta,
    SampleRecord,
)

PAD = -1
ALGORITHMS = ["first_fit", "best_fit", "wrap", "best_fit_decreasing"]


@pytest.fixture(scope="module", params=["native", "twin"], autouse=True)
def placement(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the module once per placement implementation, chosen as users do: ZEPHON_NATIVE."""
    if request.param == "native":
        if os.environ.get("ZEPHON_NATIVE", "").strip().lower() in ("0", "false", "no", "off"):
            pytest.skip("the compiled placement kernel is disabled by ZEPHON_NATIVE")
        if not native_available():
            pytest.skip("the compiled placement kernel is not built (no C compiler?)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZEPHON_NATIVE", "1" if request.param == "native" else "0")
        yield request.param


def doc(i: int, n: int, *, lane: int = 0, chunk: int = 0, comp: int = 0,
        mask: list[int] | None = None, base: int | None = None) -> SampleRecord:
    """Document ``i`` of ``n`` tokens (``base + k``, base ``10*(i+1)`` by default)."""
    start = 10 * (i + 1) if base is None else base
    payload: dict[str, Any] = {"input_ids": np.arange(start, start + n, dtype=np.int32)}
    if mask is not None:
        payload["loss_mask"] = np.array(mask, dtype=np.int32)
    meta = SampleMeta((0, 0, i), lane_id=lane, chunk_id=chunk, chunk_offset=i,
                      component_sample_counts={comp: 1})
    return SampleRecord(meta, payload)


def docs(lengths: list[int], **kwargs: Any) -> list[SampleRecord]:
    return [doc(i, n, **kwargs) for i, n in enumerate(lengths)]


def accumulator(op: PackFlat | PackSequences, microbatch_size: int | None = None):
    return op.accumulator(deterministic=True, ctx=OpContext(microbatch_size=microbatch_size))


def assemble(op: Any, microbatches: list[list[Any]]) -> list[SampleRecord]:
    return [r for mb in microbatches for r in op.process_many(mb)]


def run(op: Any, records: list[SampleRecord]) -> list[SampleRecord]:
    """Push everything, flush at end of stream, assemble: the records a runner would emit."""
    acc = accumulator(op)
    return assemble(op, acc.push_many(records) + acc.flush())


def rows(out: list[SampleRecord]) -> list[list[int]]:
    return [r.payload["input_ids"].tolist() for r in out if not r.meta.tombstone]


def positions(out: list[SampleRecord]) -> list[list[int]]:
    return [r.payload["positions"].tolist() for r in out if not r.meta.tombstone]


def refs(record: SampleRecord) -> list[tuple[int, tuple[int, ...], bool]]:
    """``(chunk_offset, lineage, is_last_child)`` of every contributor."""
    return [(r.cursor.chunk_offset, r.cursor.lineage, r.is_last_child)
            for r in record.meta.contributors]


def info(record: SampleRecord) -> dict[str, int]:
    return record.meta.tags[PACKING_METADATA_TAG]


# --------------------------------------------------------------------------- worked examples


def test_first_fit_worked_example_from_the_module_docstring():
    out = run(PackFlat(8, num_bins=2, pad_token_id=PAD), docs([5, 4, 3, 2, 6, 7]))
    assert rows(out) == [
        [10, 11, 12, 13, 14, 30, 31, 32],
        [20, 21, 22, 23, 40, 41, PAD, PAD],
        [50, 51, 52, 53, 54, 55, PAD, PAD],
        [60, 61, 62, 63, 64, 65, 66, PAD],
    ]
    assert positions(out) == [
        [0, 1, 2, 3, 4, 0, 1, 2],
        [0, 1, 2, 3, 0, 1, 0, 1],
        [0, 1, 2, 3, 4, 5, 0, 1],
        [0, 1, 2, 3, 4, 5, 6, 0],
    ]
    assert [r.meta.padding_length for r in out] == [0, 2, 2, 1]
    assert [info(r)["num_segments"] for r in out] == [2, 2, 1, 1]
    assert all(r.payload["input_ids"].dtype == np.int32 for r in out)
    assert all(r.payload["positions"].dtype == np.int32 for r in out)
    assert "loss_mask" not in out[0].payload


def test_first_fit_and_best_fit_differ_on_the_same_stream():
    lengths = [5, 6, 2, 3]
    first = run(PackFlat(8, pad_token_id=PAD), docs(lengths))
    assert rows(first) == [
        [10, 11, 12, 13, 14, 30, 31, PAD],
        [20, 21, 22, 23, 24, 25, PAD, PAD],
        [40, 41, 42, PAD, PAD, PAD, PAD, PAD],
    ]
    best = run(PackFlat(8, algorithm="best_fit", pad_token_id=PAD), docs(lengths))
    # d2 goes to the tighter bin (d1, room 2), which fills; d3 then fills d0's bin.
    assert rows(best) == [
        [20, 21, 22, 23, 24, 25, 30, 31],
        [10, 11, 12, 13, 14, 40, 41, 42],
    ]
    assert [r.meta.padding_length for r in best] == [0, 0]


def test_best_fit_ties_go_to_the_earliest_opened_bin():
    out = run(PackFlat(10, algorithm="best_fit", pad_token_id=PAD), docs([7, 7, 3]))
    assert rows(out)[0] == [10, 11, 12, 13, 14, 15, 16, 30, 31, 32]
    assert rows(out)[1] == [20, 21, 22, 23, 24, 25, 26, PAD, PAD, PAD]


def test_wrap_concatenates_and_cuts_documents_across_rows():
    out = run(PackFlat(4, algorithm="wrap", pad_token_id=PAD), docs([3, 3, 2]))
    assert rows(out) == [[10, 11, 12, 20], [21, 22, 30, 31]]
    assert positions(out) == [[0, 1, 2, 0], [0, 1, 0, 1]]
    assert [r.meta.padding_length for r in out] == [0, 0]
    # d1 is cut in two: child 0 in the first row (not closing), child 1 closes it.
    assert refs(out[0]) == [(0, (), True), (1, (0,), False)]
    assert refs(out[1]) == [(1, (1,), True), (2, (), True)]
    # A row's meta is its first piece's meta made a child.
    assert (out[0].meta.chunk_offset, out[0].meta.lineage) == (0, (0,))
    assert (out[1].meta.chunk_offset, out[1].meta.lineage) == (1, (1, 0))
    assert [r.meta.component_sample_counts for r in out] == [{0: 1}, {0: 2}]
    assert [r.meta.component_token_counts for r in out] == [{0: 4}, {0: 4}]


def test_wrap_pads_only_at_flush_and_splits_long_documents_into_children():
    out = run(PackFlat(4, algorithm="wrap", pad_token_id=PAD), docs([2, 9]))
    assert rows(out) == [[10, 11, 20, 21], [22, 23, 24, 25], [26, 27, 28, PAD]]
    assert positions(out)[2] == [0, 1, 2, 0]
    assert [r.meta.padding_length for r in out] == [0, 0, 1]
    assert refs(out[0]) == [(0, (), True), (1, (0,), False)]
    assert refs(out[1]) == [(1, (1,), False)]
    assert refs(out[2]) == [(1, (2,), True)]


def test_wrap_min_sequence_length_closes_a_row_with_too_little_room():
    out = run(PackFlat(6, algorithm="wrap", min_sequence_length=3, pad_token_id=PAD),
              docs([4, 3]))
    # After d0 the row has room 2 < 3: it goes out padded, d1 starts a fresh row.
    assert rows(out) == [[10, 11, 12, 13, PAD, PAD], [20, 21, 22, PAD, PAD, PAD]]


# --------------------------------------------------------------------------- best fit decreasing


def bfd(max_length: int, window: int, **kwargs: Any) -> PackFlat:
    return PackFlat(max_length, algorithm="best_fit_decreasing", bfd_window=window,
                    pad_token_id=PAD, **kwargs)


def test_best_fit_decreasing_worked_example_from_the_module_docstring():
    lengths = [3, 6, 2, 5, 2, 4]
    first = run(PackFlat(8, num_bins=2, pad_token_id=PAD), docs(lengths))
    assert [r.meta.padding_length for r in first] == [2, 1, 3, 4]
    out = run(bfd(8, 6), docs(lengths))
    assert rows(out) == [
        [20, 21, 22, 23, 24, 25, 30, 31],
        [40, 41, 42, 43, 44, 10, 11, 12],
        [60, 61, 62, 63, 50, 51, PAD, PAD],
    ]
    assert positions(out)[2] == [0, 1, 2, 3, 0, 1, 0, 1]
    assert [refs(r) for r in out] == [[(1, (), True), (2, (), True)],
                                      [(3, (), True), (0, (), True)],
                                      [(5, (), True), (4, (), True)]]
    # A row's meta is its first piece's meta made a child.
    assert [(r.meta.chunk_offset, r.meta.lineage) for r in out] == [(1, (0,)), (3, (0,)),
                                                                    (5, (0,))]


def test_best_fit_decreasing_emits_a_window_when_its_last_document_arrives():
    op = bfd(8, 3)
    acc = accumulator(op)
    assert acc.push_many(docs([3, 6])) == [] and acc.has_pending_data(0)
    # d0..d2 go out as d2 arrives (6 | 5 + 3); d3 opens the next window.
    emitted = assemble(op, acc.push_many([doc(2, 5), doc(3, 2)]))
    assert rows(emitted) == [[20, 21, 22, 23, 24, 25, PAD, PAD],
                             [30, 31, 32, 33, 34, 10, 11, 12]]
    assert acc.has_pending_data(0)
    assert rows(assemble(op, acc.flush(reset=True, lane_id=0))) == [
        [40, 41, PAD, PAD, PAD, PAD, PAD, PAD]]
    assert not acc.has_pending_data()
    # After the reset the lane counts a fresh window.
    assert acc.push_many(docs([1, 1])) == [] and len(acc.push_many([doc(5, 1)])) == 1


def test_best_fit_decreasing_lets_tombstones_pass_ahead_of_the_documents_it_holds():
    op = bfd(8, 10, oversized="drop")
    acc = accumulator(op)
    stream = [doc(0, 3), tombstone(doc(1, 2), "filter"), doc(2, 0), doc(3, 20), doc(4, 4)]
    first = assemble(op, acc.push_many(stream))
    assert [(r.meta.chunk_offset, r.meta.tags[TOMBSTONE_REASON_TAG]) for r in first] == [
        (1, "filter"), (2, "empty"), (3, "oversized")]
    assert rows(assemble(op, acc.flush())) == [[50, 51, 52, 53, 10, 11, 12, PAD]]


def test_best_fit_decreasing_splits_long_documents_and_only_the_last_piece_closes():
    out = run(bfd(4, 10), docs([2, 9, 2]))
    assert rows(out) == [[20, 21, 22, 23], [24, 25, 26, 27], [10, 11, 30, 31],
                         [28, PAD, PAD, PAD]]
    assert [refs(r) for r in out] == [[(1, (0,), False)], [(1, (1,), False)],
                                      [(0, (), True), (2, (), True)], [(1, (2,), True)]]


def test_best_fit_decreasing_truncates_and_counts_the_tail():
    out = run(bfd(4, 10, oversized="truncate"), docs([7, 2]))
    assert rows(out) == [[10, 11, 12, 13], [20, 21, PAD, PAD]]
    assert [info(r)["truncated_tokens"] for r in out] == [3, 0]


def test_best_fit_decreasing_pack_sequences_keeps_segments_in_placement_order():
    records = docs([1, 3, 2])
    out = run(PackSequences(4, algorithm="best_fit_decreasing", bfd_window=3), records)
    (row, second) = (r.payload["packed_samples"] for r in out)
    assert row[0] is records[1].payload and row[1] is records[0].payload
    assert second[0] is records[2].payload


def test_bfd_window_is_in_the_config_only_for_best_fit_decreasing():
    assert "bfd_window" not in PackFlat(8).config()
    assert PackFlat(8, algorithm="best_fit_decreasing").config()["bfd_window"] == 4096
    assert DEFAULT_BFD_WINDOW == 4096
    config = PackSequences(8, algorithm="best_fit_decreasing", bfd_window=16).config()
    assert config["bfd_window"] == 16 and config["algorithm"] == "best_fit_decreasing"


# --------------------------------------------------------------------------- positions, mask


def test_positions_restart_per_segment_and_padding_is_its_own_segment():
    out = run(PackFlat(10, pad_token_id=PAD), docs([3, 2, 1]))
    assert positions(out) == [[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]]
    assert out[0].meta.padding_length == 4
    assert info(out[0]) == {"num_segments": 3, "num_tokens": 6, "truncated_tokens": 0,
                            "padding_length": 4}


def test_emit_positions_false_leaves_them_out():
    out = run(PackFlat(6, emit_positions=False), docs([2]))
    assert sorted(out[0].payload) == ["input_ids"]
    assert rows(out) == [[10, 11, 0, 0, 0, 0]]


def test_loss_mask_is_carried_aligned_and_padding_gets_zero():
    records = [doc(0, 3, mask=[0, 1, 1]), doc(1, 2, mask=[1, 0])]
    out = run(PackFlat(8), records)
    assert out[0].payload["loss_mask"].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]


def test_loss_mask_missing_on_some_documents_counts_as_supervised():
    records = [doc(0, 2, mask=[0, 1]), doc(1, 2)]
    out = run(PackFlat(6), records)
    assert out[0].payload["loss_mask"].tolist() == [0, 1, 1, 1, 0, 0]


def test_loss_mask_follows_split_pieces():
    out = run(PackFlat(4, pad_token_id=PAD), [doc(0, 6, mask=[0, 1, 0, 1, 1, 0])])
    assert [r.payload["loss_mask"].tolist() for r in out] == [[0, 1, 0, 1], [1, 0, 0, 0]]


# --------------------------------------------------------------------------- oversized, empty


def test_oversized_split_gives_children_and_only_the_last_piece_closes():
    out = run(PackFlat(4, pad_token_id=PAD), docs([10]))
    assert rows(out) == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, PAD, PAD]]
    assert [refs(r) for r in out] == [[(0, (0,), False)], [(0, (1,), False)], [(0, (2,), True)]]
    assert [r.meta.lineage for r in out] == [(0, 0), (1, 0), (2, 0)]
    assert [r.meta.component_sample_counts for r in out] == [{}, {}, {0: 1}]
    assert [r.meta.component_token_counts for r in out] == [{0: 4}, {0: 4}, {0: 2}]
    assert len({r.meta.cursor for r in out}) == 3  # packed cursors are unique


def test_full_pieces_go_out_alone_without_pushing_an_open_bin_out():
    out = run(PackFlat(4, num_bins=1, pad_token_id=PAD), docs([1, 10]))
    # d0's bin stays open while d1's two full pieces leave; d1's tail then joins it.
    assert rows(out) == [[20, 21, 22, 23], [24, 25, 26, 27], [10, 28, 29, PAD]]
    assert refs(out[2]) == [(0, (), True), (1, (2,), True)]


def test_oversized_drop_tombstones_the_document():
    out = run(PackFlat(4, oversized="drop", pad_token_id=PAD), docs([2, 5]))
    tomb = [r for r in out if r.meta.tombstone]
    assert len(tomb) == 1 and tomb[0].payload is None
    assert tomb[0].meta.tags[TOMBSTONE_REASON_TAG] == "oversized"
    assert tomb[0].meta.chunk_offset == 1
    assert rows(out) == [[10, 11, PAD, PAD]]


def test_oversized_truncate_keeps_the_head_closes_the_document_and_counts_the_tail():
    out = run(PackFlat(4, oversized="truncate", pad_token_id=PAD), docs([7, 2]))
    assert rows(out) == [[10, 11, 12, 13], [20, 21, PAD, PAD]]
    assert refs(out[0]) == [(0, (), True)]
    assert info(out[0])["truncated_tokens"] == 3
    assert info(out[1])["truncated_tokens"] == 0
    assert not any(r.meta.tombstone for r in out)


def test_wrap_truncate_counts_the_tail_once_in_the_row_that_closes_the_document():
    out = run(PackFlat(4, algorithm="wrap", oversized="truncate", pad_token_id=PAD),
              docs([2, 9]))
    # d1 keeps 4 tokens, cut across two rows; its 5 dropped tokens are counted once.
    assert rows(out) == [[10, 11, 20, 21], [22, 23, PAD, PAD]]
    assert [info(r)["truncated_tokens"] for r in out] == [0, 5]
    assert refs(out[0]) == [(0, (), True), (1, (0,), False)]
    assert refs(out[1]) == [(1, (1,), True)]


def test_empty_documents_become_tombstones():
    out = run(PackFlat(4, pad_token_id=PAD), docs([0, 2]))
    assert out[0].meta.tombstone and out[0].meta.tags[TOMBSTONE_REASON_TAG] == "empty"
    assert rows(out) == [[20, 21, PAD, PAD]]


# --------------------------------------------------------------------------- tombstones


def test_tombstones_pass_through_at_once_and_in_order():
    op = PackFlat(8, oversized="drop")
    acc = accumulator(op)
    stream = [doc(0, 3), tombstone(doc(1, 2), "filter"), doc(2, 0), doc(3, 20),
              tombstone(doc(4, 1), "filter")]
    first = assemble(op, acc.push_many(stream))
    assert [(r.meta.chunk_offset, r.meta.tags[TOMBSTONE_REASON_TAG]) for r in first] == [
        (1, "filter"), (2, "empty"), (3, "oversized"), (4, "filter")]
    # A row closed before a tombstone arrives leaves before it.
    second = assemble(op, acc.push_many([doc(5, 5), tombstone(doc(6, 1), "filter")]))
    assert [r.meta.tombstone for r in second] == [False, True]
    assert refs(second[0]) == [(0, (), True), (5, (), True)]
    assert not acc.has_pending_data()


# --------------------------------------------------------------------------- bin limits


def test_when_num_bins_are_open_the_fullest_goes_out():
    op = PackFlat(10, num_bins=2, pad_token_id=PAD)
    acc = accumulator(op)
    emitted = assemble(op, acc.push_many(docs([6, 7, 5])))
    assert rows(emitted) == [[20, 21, 22, 23, 24, 25, 26, PAD, PAD, PAD]]
    assert rows(assemble(op, acc.flush())) == [
        [10, 11, 12, 13, 14, 15, PAD, PAD, PAD, PAD],
        [30, 31, 32, 33, 34, PAD, PAD, PAD, PAD, PAD],
    ]


def test_fullest_bin_ties_go_to_the_earliest_opened():
    op = PackFlat(10, num_bins=2, pad_token_id=PAD)
    acc = accumulator(op)
    emitted = assemble(op, acc.push_many(docs([6, 6, 5])))
    assert rows(emitted) == [[10, 11, 12, 13, 14, 15, PAD, PAD, PAD, PAD]]


def test_min_sequence_length_emits_a_bin_whose_room_is_too_small():
    op = PackFlat(10, min_sequence_length=3, pad_token_id=PAD)
    acc = accumulator(op)
    emitted = assemble(op, acc.push_many(docs([8])))
    assert rows(emitted) == [[10, 11, 12, 13, 14, 15, 16, 17, PAD, PAD]]
    assert not acc.has_pending_data(0)
    emitted = assemble(op, acc.push_many([doc(1, 6), doc(2, 1)]))
    assert emitted == []  # room 3 is still useful
    emitted = assemble(op, acc.push_many([doc(3, 1)]))
    assert rows(emitted) == [[20, 21, 22, 23, 24, 25, 30, 40, PAD, PAD]]
    relaxed = accumulator(PackFlat(10, pad_token_id=PAD))
    assert relaxed.push_many(docs([8])) == [] and relaxed.has_pending_data(0)


# --------------------------------------------------------------------------- lanes and flush


def _per_lane(out: list[SampleRecord]) -> dict[int, list[SampleRecord]]:
    lanes: dict[int, list[SampleRecord]] = {}
    for r in out:
        lanes.setdefault(r.meta.lane_id, []).append(r)
    return lanes


def _lane_stream(seed: int, n: int, lanes: int) -> list[SampleRecord]:
    rng = np.random.default_rng(seed)
    return [doc(i, int(rng.integers(0, 30)), lane=int(rng.integers(0, lanes)), base=100 * i)
            for i in range(n)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_interleaved_lanes_give_each_lane_its_own_output(algorithm):
    window = {"bfd_window": 7} if algorithm == "best_fit_decreasing" else {}
    op = PackFlat(16, num_bins=3, algorithm=algorithm, oversized="split", **window)
    stream = _lane_stream(1, 120, 3)
    together = _per_lane(run(op, stream))
    for lane in range(3):
        alone = run(op, [r for r in stream if r.meta.lane_id == lane])
        assert together[lane] == alone
    assert all(len({r.meta.lane_id for r in mb}) == 1 for mb in accumulator(op).push_many(stream))


def test_flush_reset_of_one_lane_leaves_it_fresh_and_the_others_untouched():
    op = PackFlat(16, num_bins=3)
    stream = _lane_stream(2, 80, 2)
    before, after = stream[:40], stream[40:]
    acc = accumulator(op)
    early = assemble(op, acc.push_many(before))
    assert acc.has_pending_data(0) and acc.has_pending_data(1)
    flushed = assemble(op, acc.flush(reset=True, lane_id=0))
    assert flushed and {r.meta.lane_id for r in flushed} == {0}
    assert not acc.has_pending_data(0) and acc.has_pending_data(1)
    late = assemble(op, acc.push_many(after) + acc.flush())
    # Lane 0 after the reset behaves exactly like a fresh accumulator.
    fresh = run(op, [r for r in after if r.meta.lane_id == 0])
    assert _per_lane(late)[0] == fresh
    # Lane 1 never noticed: its whole output equals lane 1 run alone.
    lane1 = [r for r in early + flushed + late if r.meta.lane_id == 1]
    assert lane1 == run(op, [r for r in stream if r.meta.lane_id == 1])


def test_end_of_stream_flush_emits_lanes_in_ascending_order_and_bins_in_opening_order():
    op = PackFlat(10, num_bins=4)
    acc = accumulator(op)
    stream = [doc(0, 6, lane=2), doc(1, 6, lane=0), doc(2, 6, lane=1), doc(3, 7, lane=0)]
    assert acc.push_many(stream) == []
    out = assemble(op, acc.flush())
    assert [(r.meta.lane_id, r.meta.chunk_offset) for r in out] == [(0, 1), (0, 3), (1, 2), (2, 0)]
    assert not acc.has_pending_data() and acc.flush() == []
    assert acc.flush(reset=True, lane_id=7) == []


def test_microbatches_hold_one_lane_and_at_most_the_configured_size():
    op = PackFlat(4)
    acc = accumulator(op, microbatch_size=2)
    stream = [doc(i, 4, lane=i % 2) for i in range(7)]
    mbs = acc.push_many(stream)
    assert [len(mb) for mb in mbs] == [2, 2, 2, 1]
    assert [[r.meta.chunk_offset for r in mb] for mb in mbs] == [[0, 2], [4, 6], [1, 3], [5]]


def test_decisions_do_not_depend_on_how_upstream_groups_the_stream():
    op = PackFlat(16, num_bins=2, algorithm="best_fit")
    stream = _lane_stream(3, 60, 2)
    acc = accumulator(op)
    pieces = []
    for i in range(0, len(stream), 7):
        pieces.extend(acc.push_many(stream[i:i + 7]))
    one_by_one = assemble(op, pieces + acc.flush())
    assert _per_lane(one_by_one) == _per_lane(run(op, stream))


# --------------------------------------------------------------------------- plans and assembly


def test_the_accumulator_emits_rows_assembled_with_their_final_meta():
    records = docs([3, 2])
    acc = accumulator(PackFlat(8, pad_token_id=PAD))
    (row,) = [r for mb in acc.push_many(records) + acc.flush() for r in mb]
    assert row.payload["input_ids"].tolist() == [10, 11, 12, 20, 21, PAD, PAD, PAD]
    assert row.payload["positions"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert row.meta.padding_length == 3
    assert refs(row) == [(0, (), True), (1, (), True)]


def test_process_many_leaves_the_assembled_rows_as_they_are_whatever_their_grouping():
    op = PackFlat(16, num_bins=3)
    acc = accumulator(op)
    stream = _lane_stream(4, 60, 1)
    emitted = [r for mb in acc.push_many(stream) + acc.flush() for r in mb]
    together = op.process_many(emitted)
    singly = [r for p in emitted for r in op.process_one(p)]
    assert together == singly == emitted
    assert all(set(r.payload) == {"input_ids", "positions"} for r in together
               if not r.meta.tombstone)


def test_assemble_flat_row_accepts_lists_and_bare_arrays():
    plan = [([5, 6, 7], 1, 3), (np.array([8, 9], dtype=np.int64), 0, 2)]
    row = assemble_flat_row(plan, 6, pad_token_id=PAD)
    assert row["input_ids"].tolist() == [6, 7, 8, 9, PAD, PAD]
    assert row["positions"].tolist() == [0, 1, 0, 1, 0, 1]


# --------------------------------------------------------------------------- payload forms


def test_bare_array_payloads_and_token_field_detection():
    meta = SampleMeta((0, 0, 0), lane_id=0, chunk_id=0, component_sample_counts={0: 1})
    bare = SampleRecord(meta, np.array([1, 2], dtype=np.int64))
    assert rows(run(PackFlat(3), [bare])) == [[1, 2, 0]]
    # "auto" prefers input_ids, then tokens, token_ids, ids.
    named = SampleRecord(meta, {"ids": np.array([9]), "tokens": np.array([3, 4])})
    assert rows(run(PackFlat(3), [named])) == [[3, 4, 0]]
    assert rows(run(PackFlat(3, tokens_field="ids"), [named])) == [[9, 0, 0]]


@pytest.mark.parametrize(("payload", "message"), [
    ({"text": "hello"}, "cannot detect the token field"),
    ({"input_ids": np.zeros((2, 2), dtype=np.int32)}, "1-D sequence of integer ids"),
    ({"input_ids": np.zeros(3, dtype=np.float32)}, "1-D sequence of integer ids"),
    ({"input_ids": np.arange(3), "loss_mask": np.ones(2)}, "aligned with the tokens"),
])
def test_bad_payloads_raise_naming_the_record(payload, message):
    record = SampleRecord(SampleMeta((4, 5, 6), lane_id=0, chunk_id=0), payload)
    with pytest.raises(ValueError, match=message) as err:
        accumulator(PackFlat(8)).push_many([record])
    assert "(4, 5, 6)" in str(err.value)


def test_a_batch_element_is_rejected():
    with pytest.raises(TypeError, match="before batch"):
        accumulator(PackFlat(8)).push_many([SampleBatch([doc(0, 2)])])


# --------------------------------------------------------------------------- pack_sequences


def test_pack_sequences_keeps_whole_documents_as_their_payload_objects():
    records = docs([3, 4, 2])
    out = run(PackSequences(6), records)
    first, second = (r.payload["packed_samples"] for r in out)
    assert len(first) == 2 and first[0] is records[0].payload and first[1] is records[2].payload
    assert len(second) == 1 and second[0] is records[1].payload
    assert [r.meta.padding_length for r in out] == [None, None]
    assert info(out[0]) == {"num_segments": 2, "num_tokens": 5, "truncated_tokens": 0}
    assert refs(out[0]) == [(0, (), True), (2, (), True)]
    assert out[0].meta.component_sample_counts == {0: 2}


def test_pack_sequences_splits_oversized_documents_into_sliced_children():
    record = doc(0, 5, mask=[1, 0, 1, 0, 1])
    record.payload["text"] = "kept as is"
    out = run(PackSequences(2), [record])
    pieces = [r.payload["packed_samples"][0] for r in out]
    assert [p["input_ids"].tolist() for p in pieces] == [[10, 11], [12, 13], [14]]
    assert [p["loss_mask"].tolist() for p in pieces] == [[1, 0], [1, 0], [1]]
    assert all(p["text"] == "kept as is" for p in pieces)
    assert [refs(r) for r in out] == [[(0, (0,), False)], [(0, (1,), False)], [(0, (2,), True)]]
    assert np.shares_memory(pieces[0]["input_ids"], record.payload["input_ids"])


def test_pack_sequences_wrap_and_truncate():
    wrapped = run(PackSequences(4, algorithm="wrap"), docs([3, 3]))
    assert [[p["input_ids"].tolist() for p in r.payload["packed_samples"]] for r in wrapped] == [
        [[10, 11, 12], [20]], [[21, 22]]]
    cut = run(PackSequences(2, oversized="truncate"), docs([5]))
    assert cut[0].payload["packed_samples"][0]["input_ids"].tolist() == [10, 11]
    assert info(cut[0])["truncated_tokens"] == 3


# --------------------------------------------------------------------------- operator surface


def test_traits_names_and_config():
    flat = PackFlat(2049, pad_token_id=3)
    assert flat.name == "pack_flat" and PackSequences.name == "pack_sequences"
    assert flat.traits() == OpTraits(preserves_cursor_order=False, fan_out=True, inline=True)
    config = flat.config()
    assert {k: v for k, v in config.items() if k != "op"} == {
        "max_length": 2049, "num_bins": 8, "algorithm": "first_fit", "tokens_field": "auto",
        "min_sequence_length": 1, "oversized": "split", "pad_token_id": 3,
        "emit_positions": True}
    assert config["op"].endswith("PackFlat")
    assert "emit_positions" not in PackSequences(8).config()
    assert isinstance(accumulator(flat), PackFlatAccumulator)
    assert accumulator(flat).reads_payload is True


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_length": 0}, "max_length must be an integer >= 1, got 0"),
    ({"max_length": 2.5}, "max_length"),
    ({"max_length": True}, "max_length"),
    ({"num_bins": 0}, "num_bins must be an integer >= 1, got 0"),
    ({"algorithm": "next_fit"}, "unknown algorithm 'next_fit'; use one of 'first_fit'"),
    ({"min_sequence_length": 0}, r"min_sequence_length must be an integer in 1\.\.8, got 0"),
    ({"min_sequence_length": 9}, r"min_sequence_length must be an integer in 1\.\.8, got 9"),
    ({"oversized": "clip"}, "unknown oversized 'clip'; use one of 'split', 'drop', 'truncate'"),
    ({"tokens_field": ""}, "tokens_field"),
    ({"pad_token_id": 2**40}, "pad_token_id"),
    ({"emit_positions": 1}, "emit_positions"),
    ({"bfd_window": 16},
     "bfd_window=16 applies only to algorithm='best_fit_decreasing', not 'first_fit'; remove"),
    ({"algorithm": "best_fit_decreasing", "bfd_window": 0},
     "bfd_window must be an integer >= 1, got 0; pass how many documents"),
])
def test_constructor_rejects_bad_arguments_with_the_fix(kwargs, message):
    params = {"max_length": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        PackFlat(params.pop("max_length"), **params)
    if "pad_token_id" not in kwargs and "emit_positions" not in kwargs:
        params = {"max_length": 8, **kwargs}
        with pytest.raises(ValueError, match=message):
            PackSequences(params.pop("max_length"), **params)


# --------------------------------------------------------------------------- to_training


def test_rows_feed_to_training_with_labels_and_cu_seqlens():
    out = run(PackFlat(8, num_bins=2, pad_token_id=PAD), docs([5, 4, 3, 2, 6, 7]))
    batch = SampleBatch(out).to_training(return_labels=True, return_cu_seqlens=True,
                                         dtype=np.int64)
    # Segments [5,3], [4,2,pad 2], [6,pad 2], [7,pad 1], cut to the 7 input tokens.
    assert batch["cu_seqlens"].tolist() == [[0, 5, 7, 7], [0, 4, 6, 7], [0, 6, 7, 7],
                                            [0, 7, 7, 7]]
    assert batch["max_seqlen"].tolist() == [5, 4, 6, 7]
    assert batch["labels"][1].tolist() == [21, 22, 23, 40, 41, -100, -100]
    assert batch["labels"][3].tolist() == [61, 62, 63, 64, 65, 66, -100]


def test_random_rows_give_cu_seqlens_matching_the_placement():
    from zephon_torch.ops._binpack import BinPlacer

    op = PackFlat(32, num_bins=4)
    acc = accumulator(op)
    stream = _lane_stream(5, 80, 1)
    out = [r for mb in acc.push_many(stream) + acc.flush() for r in mb if not r.meta.tombstone]
    batch = SampleBatch(out).to_training(return_labels=True, return_cu_seqlens=True,
                                         dtype=np.int64, flatten=True)
    # The same lengths placed by the kernel alone give each row's pieces.
    placer = BinPlacer(32, num_bins=4)
    lengths = [len(r.payload["input_ids"]) for r in stream if len(r.payload["input_ids"])]
    placed = [placer.place(np.array(lengths, dtype=np.int64)), placer.flush()]
    pieces = [[int(stop - start) for _, start, stop, _ in p.row_pieces(row)]
              for p in placed for row in range(p.rows)]
    assert len(pieces) == len(out)
    bounds = [0]
    for sizes in pieces:
        offset, used = bounds[-1], 0
        for size in sizes:
            used += size
            bounds.append(offset + min(used, 31))  # a last full segment loses its last token
        if used < 31:
            bounds.append(offset + 31)  # the padding segment
        bounds = sorted(set(bounds))
    assert batch["cu_seqlens"].tolist() == bounds


# --------------------------------------------------------------------------- properties


def _closings(out: list[SampleRecord]) -> Counter:
    closed: Counter = Counter()
    for r in out:
        if r.meta.tombstone:
            closed[r.meta.cursor.base_offset] += 1
        else:
            closed.update(ref.cursor.base_offset for ref in r.meta.contributors
                          if ref.is_last_child)
    return closed


def _check_flat_row(record: SampleRecord, max_length: int) -> list[int]:
    """Shape invariants of one row; returns its segment lengths (padding excluded)."""
    ids, pos = record.payload["input_ids"], record.payload["positions"]
    assert ids.shape == pos.shape == (max_length,)
    assert ids.dtype == pos.dtype == np.int32
    starts = [*np.flatnonzero(pos == 0).tolist(), max_length]
    lengths = np.diff(starts).tolist()
    for start, n in zip(starts, lengths):
        assert pos[start:start + n].tolist() == list(range(n))
    pad = record.meta.padding_length
    segments = lengths[:-1] if pad else lengths
    assert sum(segments) + pad == max_length
    assert (ids[max_length - pad:] == PAD).all()
    assert len(segments) == info(record)["num_segments"] == len(record.meta.contributors)
    assert sum(record.meta.component_token_counts.values()) == max_length - pad
    return segments


def _rebuild(out: list[SampleRecord], max_length: int) -> dict[tuple[int, int], list[int]]:
    """Reassemble every document from its pieces (ordered by lineage)."""
    pieces: dict[tuple[int, int], list[tuple[tuple[int, ...], list[int]]]] = {}
    for r in out:
        if r.meta.tombstone:
            continue
        offset = 0
        for ref, n in zip(r.meta.contributors, _check_flat_row(r, max_length)):
            tokens = r.payload["input_ids"][offset:offset + n].tolist()
            pieces.setdefault(ref.cursor.base_offset, []).append((ref.cursor.lineage, tokens))
            offset += n
    return {base: [t for _, part in sorted(parts) for t in part]
            for base, parts in pieces.items()}


@st.composite
def streams(draw: Any) -> dict[str, Any]:
    max_length = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, 3 * max_length), max_size=40))
    lanes = [draw(st.integers(0, 2)) for _ in lengths]
    algorithm = draw(st.sampled_from(ALGORITHMS))
    window = ({"bfd_window": draw(st.integers(1, 6))} if algorithm == "best_fit_decreasing"
              else {})
    return {
        "op": PackFlat(max_length, num_bins=draw(st.integers(1, 4)), algorithm=algorithm,
                       min_sequence_length=draw(st.integers(1, max_length)),
                       oversized=draw(st.sampled_from(["split", "drop", "truncate"])),
                       pad_token_id=PAD, **window),
        "records": [doc(i, n, lane=lane, chunk=i // 5, comp=i % 2, base=1000 * i)
                    for i, (n, lane) in enumerate(zip(lengths, lanes))],
        "flush_at": draw(st.sets(st.integers(0, max(len(lengths) - 1, 0)))),
        "step": draw(st.integers(1, 8)),
    }


def _drive(op: PackFlat, records: list[SampleRecord], flush_at: set[int],
           step: int) -> list[SampleRecord]:
    """Push in slices of at most ``step``; after record ``j`` in ``flush_at``, reset its lane."""
    acc = accumulator(op, microbatch_size=3)
    mbs: list[list[Any]] = []
    pending: list[SampleRecord] = []
    for j, record in enumerate(records):
        pending.append(record)
        if len(pending) == step or j in flush_at:
            mbs.extend(acc.push_many(pending))
            pending = []
        if j in flush_at:
            mbs.extend(acc.flush(reset=True, lane_id=record.meta.lane_id))
            assert not acc.has_pending_data(record.meta.lane_id)
    mbs.extend(acc.push_many(pending) + acc.flush())
    assert not acc.has_pending_data()
    assert all(len({r.meta.lane_id for r in mb}) == 1 and len(mb) <= 3 for mb in mbs)
    return assemble(op, mbs)


@settings(max_examples=150, deadline=None)
@given(streams())
def test_every_document_is_closed_once_and_its_tokens_are_conserved(case):
    op, records = case["op"], case["records"]
    out = _drive(op, records, case["flush_at"], case["step"])
    closed = _closings(out)
    assert closed == Counter(r.meta.cursor.base_offset for r in records)
    assert len({r.meta.cursor for r in out}) == len(out)  # output cursors are unique
    lane_of = {r.meta.cursor.base_offset: r.meta.lane_id for r in records}
    for r in out:  # packers never mix lanes
        assert {lane_of[c.base_offset] for c in r.meta.contribution_cursors()} == {
            r.meta.lane_id}
    rebuilt = _rebuild(out, op.max_length)
    tombs = {r.meta.cursor.base_offset: r.meta.tags[TOMBSTONE_REASON_TAG]
             for r in out if r.meta.tombstone}
    truncated = 0
    for record in records:
        tokens = record.payload["input_ids"].tolist()
        base = record.meta.cursor.base_offset
        if not tokens:
            assert tombs[base] == "empty"
        elif len(tokens) > op.max_length and op.oversized == "drop":
            assert tombs[base] == "oversized"
        elif op.oversized == "truncate":
            assert rebuilt[base] == tokens[:op.max_length]
            truncated += len(tokens) - len(rebuilt[base])
        else:
            assert rebuilt[base] == tokens
    rows_out = [r for r in out if not r.meta.tombstone]
    assert truncated == sum(info(r)["truncated_tokens"] for r in rows_out)
    samples = Counter()
    for r in rows_out:
        samples.update(r.meta.component_sample_counts)
    assert sum(samples.values()) == len(records) - len(tombs)


@settings(max_examples=100, deadline=None)
@given(streams())
def test_a_lane_reset_at_each_flush_point_equals_fresh_runs_between_them(case):
    """Interleaved lanes with flush sentinels = per lane, fresh packers between sentinels."""
    op, records, flush_at = case["op"], case["records"], case["flush_at"]
    together = _per_lane(_drive(op, records, flush_at, case["step"]))
    for lane in {r.meta.lane_id for r in records}:
        expected: list[SampleRecord] = []
        epoch: list[SampleRecord] = []
        for j, record in enumerate(records):
            if record.meta.lane_id != lane:
                continue
            epoch.append(record)
            if j in flush_at:
                expected.extend(run(op, epoch))
                epoch = []
        expected.extend(run(op, epoch))
        assert together.get(lane, []) == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=30), st.integers(1, 8),
       st.sampled_from(ALGORITHMS))
def test_pack_sequences_conserves_segments(lengths, max_length, algorithm):
    records = [doc(i, n, base=1000 * i) for i, n in enumerate(lengths)]
    window = {"bfd_window": 4} if algorithm == "best_fit_decreasing" else {}
    out = run(PackSequences(max_length, algorithm=algorithm, num_bins=2, **window), records)
    assert _closings(out) == Counter(r.meta.cursor.base_offset for r in records)
    got: dict[tuple[int, int], list[tuple[tuple[int, ...], list[int]]]] = {}
    for r in out:
        if r.meta.tombstone:
            continue
        segments = r.payload["packed_samples"]
        assert sum(len(s["input_ids"]) for s in segments) <= max_length
        for ref, segment in zip(r.meta.contributors, segments, strict=True):
            got.setdefault(ref.cursor.base_offset, []).append(
                (ref.cursor.lineage, segment["input_ids"].tolist()))
    for record in records:
        if len(record.payload["input_ids"]):
            parts = sorted(got[record.meta.cursor.base_offset])
            rebuilt = [t for _, part in parts for t in part]
            assert rebuilt == record.payload["input_ids"].tolist()


# --------------------------------------------------------------------------- padding


def _heavy_tailed_documents() -> tuple[np.ndarray, list[SampleRecord]]:
    """20,000 documents of log-normal lengths (a long tail past one row), one lane."""
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(5.5, 1.0, 20_000).astype(int), 1)
    tokens = np.zeros(int(lengths.max()), dtype=np.int32)
    records = [SampleRecord(SampleMeta((0, 0, i), lane_id=0, chunk_id=0, chunk_offset=i,
                                       component_sample_counts={0: 1}),
                            {"input_ids": tokens[:n]}) for i, n in enumerate(lengths)]
    return lengths, records


def test_first_fit_padding_on_a_heavy_tailed_length_distribution_stays_near_one_percent():
    lengths, records = _heavy_tailed_documents()
    acc = PackFlatAccumulator(2049, num_bins=8)
    plans = [r for mb in acc.push_many(records) + acc.flush() for r in mb]
    padding = sum(r.meta.padding_length for r in plans) / (len(plans) * 2049)
    assert sum(2049 - r.meta.padding_length for r in plans) == int(lengths.sum())
    assert padding < 0.015, f"first_fit padding {padding:.2%}"


def test_best_fit_decreasing_pads_far_less_than_first_fit_on_the_same_distribution():
    lengths, records = _heavy_tailed_documents()
    padding = {}
    for algorithm in ("first_fit", "best_fit_decreasing"):
        acc = PackFlatAccumulator(2049, num_bins=8, algorithm=algorithm)
        plans = [r for mb in acc.push_many(records) + acc.flush() for r in mb]
        assert sum(2049 - r.meta.padding_length for r in plans) == int(lengths.sum())
        padding[algorithm] = sum(r.meta.padding_length for r in plans) / (len(plans) * 2049)
    # Windows of 4,096 documents: near-offline packing.
    assert padding["best_fit_decreasing"] < 0.0015, padding
    assert padding["best_fit_decreasing"] < padding["first_fit"] / 4, padding


def test_plain_engine_is_usable_directly():
    acc = PackingAccumulator(4)
    (mb,) = acc.push_many(docs([4]))
    assert mb[0].meta.padding_length is None
    assert mb[0].meta.contributors == (ContributorRef(doc(0, 4).meta.cursor, True),)


@settings(max_examples=150, deadline=None)
@given(streams())
def test_the_array_fast_path_decides_exactly_as_the_general_path(case):
    """Documents whose tokens are 1-D integer arrays take the packer's fast path;
    the same documents with the tokens as Python lists take the general one.
    Both must give the same rows, metas and accounting."""
    op, records = case["op"], case["records"]
    as_lists = [SampleRecord(r.meta, {"input_ids": r.payload["input_ids"].tolist()})
                for r in records]
    fast = _drive(op, records, case["flush_at"], case["step"])
    general = _drive(op, as_lists, case["flush_at"], case["step"])
    assert [r.meta for r in fast] == [r.meta for r in general]
    assert [dict(r.meta.tags) for r in fast] == [dict(r.meta.tags) for r in general]
    assert [(r.meta.component_sample_counts, r.meta.component_token_counts) for r in fast] == [
        (r.meta.component_sample_counts, r.meta.component_token_counts) for r in general]
    assert rows(fast) == rows(general)


@settings(max_examples=150, deadline=None)
@given(streams())
def test_the_compiled_kernel_and_the_twin_give_the_same_records(placement, case):
    if placement != "native":
        pytest.skip("compares both implementations; runs once, with the native parameter")
    outputs = []
    for value in ("1", "0"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("ZEPHON_NATIVE", value)
            outputs.append(_drive(case["op"], case["records"], case["flush_at"], case["step"]))
    native, twin = outputs
    assert [r.meta for r in native] == [r.meta for r in twin]
    assert [dict(r.meta.tags) for r in native] == [dict(r.meta.tags) for r in twin]
    assert rows(native) == rows(twin) and positions(native) == positions(twin)


def test_the_packer_places_with_the_implementation_zephon_native_selects(placement):
    acc = accumulator(PackFlat(8))
    acc.push_many(docs([3]))
    assert acc._lanes[0].placer.native is (placement == "native")


@pytest.mark.parametrize("case", cases_for("zephon_torch.ops.packing"))
def test_pack_flat_and_pack_sequences_keep_the_operator_contract(
        case: str, contract_data: ContractData) -> None:
    """Every runner, worker count and micro-batch size gives the inline output, each lane
    the same on any number of ranks, every sample is delivered or tombstoned once, and a
    checkpoint after any output resumes exactly (``zephon_torch.testing``)."""
    check_case(case, contract_data)
