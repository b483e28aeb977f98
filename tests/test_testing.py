"""``zephon_torch.testing``: the operator contract passes a good operator and names
what a broken one breaks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import zephon_torch as zt
from zephon_torch.ops import Operator, tombstone
from zephon_torch.testing import (
    assert_conserved,
    check_operator_contract,
    matrix,
    small_microbatch_sizes,
)
from zephon_torch.types import SampleRecord

TEXTS = [f"doc {i} " + "word " * (i % 5) for i in range(30)]
NO_PROCESSES = ("inline", "threads", "lanes")  # each process start-up costs most of a second


class ShortOnes(Operator):
    """Keeps documents of at most three words; tombstones the rest."""

    name = "short_ones"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return [rec if len(rec.payload["text"].split()) <= 3 else tombstone(rec, "long")
                for rec in elems]


class NumbersItsMicroBatch(Operator):
    """Broken: writes each record's position in its micro-batch into the payload."""

    name = "numbers"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return [SampleRecord(rec.meta, {**rec.payload, "position": i})
                for i, rec in enumerate(elems)]


class LosesOddOnes(Operator):
    """Broken: leaves records out instead of tombstoning them."""

    name = "loses"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return [rec for rec in elems if rec.meta.chunk_offset % 2 == 0]


def pipeline(op: Operator) -> zt.Pipeline:
    return zt.Pipeline.from_items(TEXTS, num_lanes=4, chunk_size=4,
                                  flush_every_k_chunks=2).apply(op)


def test_a_good_operator_keeps_the_whole_contract() -> None:
    reference = check_operator_contract(lambda: pipeline(ShortOnes()), runners=NO_PROCESSES)
    assert 0 < len(reference) < len(TEXTS)


def test_the_default_matrix_takes_each_knob_at_its_default_1_and_3() -> None:
    pipe = pipeline(ShortOnes()).batch(2)
    assert small_microbatch_sizes(pipe, 3) == {"short_ones": 3}  # batch's size is the output
    expected = matrix(NO_PROCESSES, (1, 2, 4), [None, {"short_ones": 1}, {"short_ones": 3}])
    seen: list[dict[str, Any]] = []
    original = zt.Pipeline.iter

    def spy(self: zt.Pipeline, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return original(self, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zt.Pipeline, "iter", spy)
        check_operator_contract(pipe, runners=NO_PROCESSES, world_sizes=(2,), cut_points=[1])
    assert [s for s in seen if "microbatch_sizes" in s] == expected


def test_an_output_that_depends_on_micro_batch_boundaries_fails_determinism() -> None:
    with pytest.raises(AssertionError, match=r"microbatch_sizes.*output \d+ differs"):
        check_operator_contract(pipeline(NumbersItsMicroBatch()), runners=NO_PROCESSES)


def test_a_record_left_out_fails_conservation() -> None:
    with pytest.raises(AssertionError):
        assert_conserved(pipeline(LosesOddOnes()), runner="inline")
    with pytest.raises(AssertionError):
        check_operator_contract(pipeline(LosesOddOnes()), runners=NO_PROCESSES)


def test_a_pipeline_that_delivers_nothing_proves_nothing() -> None:
    pipe = zt.Pipeline.from_items(TEXTS, num_lanes=2).filter(lambda payload: False)
    with pytest.raises(AssertionError, match="produced nothing"):
        check_operator_contract(pipe, runners=NO_PROCESSES)
