"""Stage fusion: runs of elementwise stages become one stage, with the same output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import zephon_torch as zt
from tests.harness import assert_restores_everywhere, assert_same, collect
from zephon_torch.ops.base import Element, Operator, OpTraits
from zephon_torch.ops.fused import FusedOperator
from zephon_torch.types import SampleRecord


class Barrier(Operator):
    """An identity operator that does not declare itself elementwise: never fused."""

    name = "barrier"

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        return list(elems)


def _items(n: int = 300) -> list[dict[str, Any]]:
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    return [{"text": " ".join(words[(i + j) % 5] for j in range(1 + i % 7)), "i": i}
            for i in range(n)]


def _upper(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "text": payload["text"].upper()}


def _keep(payload: dict[str, Any]) -> bool:
    return payload["i"] % 3 != 0


def _tag(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "tagged": payload["i"] * 2}


def _chain(tokenizer: Any, *, barriers: bool, shuffle: bool = False) -> zt.Pipeline:
    pipe = zt.Pipeline.from_items(_items(), num_lanes=4, chunk_size=16, seed=3)
    steps = [lambda p: p.map_transform(_upper), lambda p: p.filter(_keep),
             lambda p: p.map_transform(_tag), lambda p: p.tokenize(tokenizer)]
    for step in steps:
        pipe = step(pipe)
        if barriers:
            pipe = pipe.apply(Barrier())
    if shuffle:
        pipe = pipe.shuffle(8, seed=5)
    return pipe.batch(4)


def _stage_names(pipe: zt.Pipeline, **kwargs: Any) -> list[str]:
    it = pipe.iter(runner="inline", **kwargs)
    try:
        return [stage.name for stage in it.stages]
    finally:
        it.close()


def test_a_run_of_elementwise_stages_compiles_to_one_stage(tokenizer: Any) -> None:
    names = _stage_names(_chain(tokenizer, barriers=False))
    assert names[0] == "map_transform_1+filter+map_transform_2+tokenize"
    assert "replay_filter" in names and names[-1] == "batch"
    unfused = _stage_names(_chain(tokenizer, barriers=True))
    assert "map_transform_1" in unfused and "tokenize" in unfused


def test_a_fused_stage_takes_the_largest_override_of_its_parts(tokenizer: Any) -> None:
    pipe = _chain(tokenizer, barriers=False)
    it = pipe.iter(runner="inline", microbatch_sizes={"map_transform_2": 5, "filter": 3})
    try:
        assert it.stages[0].name == "map_transform_1+filter+map_transform_2+tokenize"
        assert it.stages[0].acc.max_batch == 5
    finally:
        it.close()
    assert_same(collect(_chain(tokenizer, barriers=True)),
                collect(pipe, runner="threads", num_workers=2,
                        microbatch_sizes={"map_transform_2": 5, "filter": 3}))


def test_remote_and_local_stages_are_not_fused(tokenizer: Any) -> None:
    base = (zt.Pipeline.from_items(_items(), num_lanes=2, chunk_size=16)
            .map_transform(_upper).map_transform(_tag, placement="remote")
            .map_transform(_upper, placement="remote"))
    names = [c.name for c in base.batch(2).compile()]  # the plan alone: no Ray started
    assert names[:2] == ["map_transform_1", "map_transform_2+map_transform_3"]
    # remote stages with other resources are not fused either
    other = base.apply(zt.ops.transform.MapTransform(_tag),
                       placement=zt.Remote(num_cpus=2)).batch(2)
    assert [c.name for c in other.compile()][:3] == [
        "map_transform_1", "map_transform_2+map_transform_3", "map_transform_4"]


@pytest.mark.parametrize("runner,workers", [("inline", 1), ("threads", 2), ("process", 2)])
def test_fused_output_equals_the_unfused_chain(tokenizer: Any, runner: str,
                                               workers: int) -> None:
    want = collect(_chain(tokenizer, barriers=True), runner="inline")
    got = collect(_chain(tokenizer, barriers=False), runner=runner, num_workers=workers)
    assert_same(want, got, label=f"fused, {runner} x {workers}")
    # the filter's tombstones really flowed through the fused stage
    it = _chain(tokenizer, barriers=False).iter(runner="inline")
    list(it)
    lanes = it.stats()["lanes"].values()
    assert sum(lane["tombstoned"].get("filter", 0) for lane in lanes) == len(_items()) // 3


def test_fused_stage_before_a_shuffle_restores_everywhere(tokenizer: Any) -> None:
    pipe = _chain(tokenizer, barriers=False, shuffle=True)
    reference = assert_restores_everywhere(
        pipe, cut_points=[0, 3, 11, 24],
        resume_settings=({"runner": "threads", "num_workers": 2}, {"runner": "inline"}))
    assert_same(collect(_chain(tokenizer, barriers=True, shuffle=True)), reference,
                label="fused vs unfused, with a shuffle")


def test_fused_operator_rejects_non_elementwise_parts() -> None:
    with pytest.raises(ValueError, match="needs at least two"):
        FusedOperator([("a", zt.ops.transform.MapTransform(_upper))])
    with pytest.raises(ValueError, match=r"'barrier'.*not elementwise"):
        FusedOperator([("a", zt.ops.transform.MapTransform(_upper)), ("barrier", Barrier())])
    assert not Barrier().traits().elementwise
    assert OpTraits().elementwise is False


def test_process_runner_cuts_bigger_micro_batches_for_elementwise_stages() -> None:
    # a user's elementwise operator keeps the base default (64) except under processes
    pipe = (zt.Pipeline.from_items(_items(), num_lanes=4, chunk_size=16, seed=3)
            .apply(_RecordsOnly("count", "n")).batch(4))
    sizes = {}
    for runner, overrides in (("process", None), ("process", {"count": 16}), ("threads", None)):
        it = pipe.iter(runner=runner, num_workers=1, microbatch_sizes=overrides)
        try:
            sizes[runner, bool(overrides)] = it.stages[0].acc.max_batch
        finally:
            it.close()
    assert sizes == {("process", False): 512, ("process", True): 16, ("threads", False): 64}
    # the built-in elementwise operators default to a chunk's worth (512) everywhere
    fused = zt.Pipeline.from_items(_items(), num_lanes=4, chunk_size=16, seed=3).map_transform(
        _upper).filter(_keep).batch(4)
    with fused.iter(runner="threads", num_workers=1) as it:
        assert it.stages[0].acc.max_batch == 512


class _RecordsOnly(Operator):
    """An elementwise user operator with no block path: it sees records."""

    def __init__(self, name: str, key: str) -> None:
        self.name, self.key, self.seen = name, key, 0
        self.inputs: list[Element] = []
        self.outputs: list[Element] = []

    def traits(self) -> OpTraits:
        return OpTraits(elementwise=True)

    def process_many(self, elems: Sequence[Element]) -> list[Element]:
        out = []
        self.inputs = list(elems)
        for rec in elems:
            self.seen += 1
            if rec.payload is not None and not rec.meta.is_sentinel:
                rec = SampleRecord(rec.meta, {**rec.payload, self.key: len(rec.payload["text"])})
            out.append(rec)
        self.outputs = out
        return out


def test_a_fused_block_runs_record_only_parts_back_to_back_on_one_view() -> None:
    from zephon_torch.block import blocks_from_elements
    from zephon_torch.ops.base import OpContext
    from zephon_torch.ops.transform import Filter, MapTransform

    pipe = zt.Pipeline.from_items(_items(40), num_lanes=1, chunk_size=64)
    first, second = _RecordsOnly("first", "n"), _RecordsOnly("second", "m")
    ops = [("map_transform", MapTransform(_upper)), ("first", first), ("second", second),
           ("filter", Filter(_keep))]
    fused = FusedOperator(ops)
    fused.setup(OpContext())
    records = list(pipe.iter(runner="inline"))
    block = blocks_from_elements(records)[0]
    got = fused.process_block(block).records()
    # the second part was handed the first part's own records, not a re-view of a block
    assert all(a is b for a, b in zip(first.outputs, second.inputs, strict=True))
    assert got == fused.process_many(records)
    assert [r.payload["n"] == r.payload["m"] == len(r.payload["text"]) for r in got
            if r.payload is not None] == [True] * (len(records) - len(records) // 3 - 1)
    assert first.seen == second.seen == 2 * len(records)  # once per path, no extra views
