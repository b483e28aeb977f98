"""A lane's first micro-batches are small and grow to the stage's size.

A stage under the default accumulator cuts each lane's records into
micro-batches of ``first_microbatch_size`` (8), then twice as many each time,
up to the stage's size: the first batch of a run, and of a resume, waits for
a few records' work instead of a full micro-batch's. Where the cuts fall never
changes the output, which these tests hold against the same pipeline at full
size from the start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
from harness import assert_same, collect

from zephon_torch.ops.accumulators import CountingAccumulator
from zephon_torch.ops.base import Operator
from zephon_torch.pipeline import Pipeline
from zephon_torch.types import SampleMeta, SampleRecord


class Recorded(Operator):
    """Upper-cases the text, and records each micro-batch's lane and size."""

    name = "recorded"
    default_microbatch_size = 64
    seen: ClassVar[list[tuple[int, int]]] = []

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        Recorded.seen.append((elems[0].meta.lane_id, len(elems)))
        return [SampleRecord(e.meta, {"text": e.payload["text"].upper()}) for e in elems]


class FullSize(Recorded):
    """The same operator, at full size from its first micro-batch."""

    first_microbatch_size = None


def _pipe(op: Operator, n: int = 600, lanes: int = 2) -> Pipeline:
    texts = [f"doc {i} " + "x" * (i % 7) for i in range(n)]
    return Pipeline.from_items(texts, num_lanes=lanes, chunk_size=100).apply(op).batch(4)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    Recorded.seen.clear()


def test_a_lanes_first_chunk_is_cut_in_growing_micro_batches_then_the_stage_size() -> None:
    collect(_pipe(Recorded()), runner="inline")
    for lane in (0, 1):
        sizes = [size for seen_lane, size in Recorded.seen if seen_lane == lane]
        # The first chunk (100 records): 8, 16, 32 and the rest of it, held back
        # for nothing; then micro-batches of 64 across chunks.
        assert sizes[:5] == [8, 16, 32, 44, 64], sizes
        assert sum(sizes) == 300
        assert all(size <= 64 for size in sizes)


def test_a_first_push_longer_than_the_ramp_goes_on_at_the_stage_size() -> None:
    acc = CountingAccumulator(64, ramp_from=8)
    records = [SampleRecord(SampleMeta((0, 0, i), 0, 0, i, {0: 1}), {"i": i})
               for i in range(300)]
    sizes = [len(b) for b in acc.push_many(records)]
    assert sizes == [8, 16, 32, 64, 64, 64, 52]
    assert [len(b) for b in acc.push_many(records[:100])] == [64]


def test_the_output_is_that_of_full_size_micro_batches() -> None:
    ramped = collect(_pipe(Recorded()), runner="inline")
    Recorded.seen.clear()
    full = collect(_pipe(FullSize()), runner="inline")
    assert Recorded.seen[0][1] == 64  # the control: no ramp
    assert_same(ramped, full)


@pytest.mark.parametrize("runner", ["threads", "process"])
def test_the_output_is_the_same_on_every_runner(runner: str) -> None:
    inline = collect(_pipe(Recorded()), runner="inline")
    assert_same(collect(_pipe(Recorded()), runner=runner, num_workers=2), inline)


def test_the_first_batch_waits_for_a_few_records_not_a_full_micro_batch() -> None:
    it = _pipe(Recorded(), lanes=1).iter(runner="inline")
    next(it)
    first_work = sum(size for _, size in Recorded.seen)
    it.close()
    Recorded.seen.clear()
    it = _pipe(FullSize(), lanes=1).iter(runner="inline")
    next(it)
    full_work = sum(size for _, size in Recorded.seen)
    it.close()
    assert first_work == 8 and full_work == 64


def test_a_resume_ramps_again_and_lands_where_it_left() -> None:
    pipe = _pipe(Recorded())
    whole = collect(pipe, runner="inline")
    it = pipe.iter(runner="inline")
    head = [next(it) for _ in range(10)]
    state = it.state_dict()
    it.close()
    Recorded.seen.clear()
    resumed = pipe.iter(runner="inline")
    resumed.load_state_dict(state)
    rest = list(resumed)
    resumed.close()
    assert Recorded.seen[0][1] == 8
    assert_same(head + rest, whole)


def test_a_stage_size_below_the_first_size_is_not_ramped() -> None:
    collect(_pipe(Recorded()), runner="inline", microbatch_sizes={"recorded": 3})
    assert {size for _, size in Recorded.seen} <= {3, 2, 1}
    assert Recorded.seen[0][1] == 3


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_first_size_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="ramp_from must be a positive integer"):
        CountingAccumulator(64, ramp_from=bad)


@pytest.mark.parametrize("lanes", [1, 2])
def test_the_ramp_reads_each_row_group_once_in_file_order(tmp_path: Any, lanes: int) -> None:
    # The first push of a lane is cut small, and its later micro-batches run after
    # the first has moved on; they must still run in the order they were cut, or
    # a fetch of the next chunk reads ahead and evicts row groups they still need.
    from corpus import write_token_parquet

    files = [str(write_token_parquet(tmp_path / f"p{i}.parquet", 3000, seed=7 + i,
                                     rows_per_group=256)) for i in range(2)]
    pipe = (Pipeline.from_parquet(files, columns=["input_ids"], num_lanes=lanes,
                                  shuffle=False).fetch().pack_flat(512).batch(4))
    with pipe.iter(runner="inline") as it:
        for _ in it:
            pass
        stats = it.stats()
    assert stats["bytes_read"] == stats["sample_bytes"]
