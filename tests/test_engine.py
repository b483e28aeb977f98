"""The engine and the consumer iterator, with user operators on an in-memory source."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from harness import assert_conserved, assert_elastic, assert_same, collect, per_lane
from memsource import MemDataset

from zephon_torch.ops.accumulators import Accumulator, CountingAccumulator
from zephon_torch.ops.base import OpContext, Operator, OpTraits, tombstone
from zephon_torch.pipeline import Pipeline
from zephon_torch.types import ContributorRef, SampleRecord


class Upper(Operator):
    name = "upper"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return [SampleRecord(e.meta, {"text": e.payload["text"].upper()}) for e in elems]


class DropOdd(Operator):
    name = "drop_odd"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return [tombstone(e, "odd") if _number(e) % 2 else e for e in elems]


def _number(record: SampleRecord) -> int:
    return int(record.payload["text"].split()[1].split("/")[0])


class Split(Operator):
    """Fan-out: every record becomes two children."""

    name = "split"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        out = []
        for e in elems:
            base = e.meta.cursor
            # only the last child closes the base sample
            first = e.meta.child(0).with_contributors([ContributorRef(base.child(0), False)])
            last = e.meta.child(1).with_contributors([ContributorRef(base.child(1), True)])
            out.append(SampleRecord(first, {"text": e.payload["text"] + "/a"}))
            out.append(SampleRecord(last, {"text": e.payload["text"] + "/b"}))
        return out

    def traits(self) -> OpTraits:
        return OpTraits(fan_out=True)


class ReturnsDicts(Operator):
    name = "bad"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return [e.payload for e in elems]


class Raises(Operator):
    name = "raises"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        for e in elems:
            if e.payload["text"] == "doc 13":
                raise KeyError("no such thing: doc 13")
        return list(elems)


class LeakyAccumulator(CountingAccumulator):
    """Wrong on purpose: a reset flush keeps one element back."""

    def flush(self, *, reset: bool = False, lane_id: int | None = None) -> list[list[Any]]:
        if not reset:
            return super().flush()
        buf = self._buffers.get(lane_id, [])
        out, self._buffers[lane_id] = buf[:-1], buf[-1:]
        return [out] if out else []


class Leaky(Operator):
    name = "leaky"

    def accumulator(self, *, deterministic: bool, ctx: OpContext) -> Accumulator:
        return LeakyAccumulator(100)


def docs(n: int) -> list[str]:
    return [f"doc {i}" for i in range(n)]


def pipe_of(n: int = 50, **config: Any) -> Pipeline:
    config.setdefault("num_lanes", 4)
    config.setdefault("chunk_size", 5)
    return Pipeline.from_sources([MemDataset(docs(n))], shuffle=False, **config)


def texts(outputs: list[Any]) -> list[str]:
    return [r.payload["text"] for r in outputs]


def test_lanes_round_robin_in_ascending_order() -> None:
    out = collect(pipe_of().apply(Upper()), runner="inline")
    assert texts(out)[:8] == ["DOC 0", "DOC 5", "DOC 10", "DOC 15",
                              "DOC 1", "DOC 6", "DOC 11", "DOC 16"]
    assert sorted(texts(out)) == sorted(d.upper() for d in docs(50))


def test_an_ended_lane_is_skipped() -> None:
    # 22 docs, chunk 5, 4 lanes: lane 0 gets chunks 0 and 4 (7 docs), the others 5.
    out = collect(pipe_of(22).apply(Upper()), runner="inline")
    lanes = [r.meta.lane_id for r in out]
    assert lanes[-4:] == [2, 3, 0, 0]
    assert len(out) == 22


@pytest.mark.parametrize("runner,workers", [("threads", 1), ("threads", 3)])
@pytest.mark.parametrize("size", [1, 3, 64])
def test_runner_workers_and_microbatch_sizes_do_not_change_output(
        runner: str, workers: int, size: int) -> None:
    pipe = pipe_of(60).apply(Upper()).apply(Split()).apply(DropOdd())
    ref = collect(pipe, runner="inline")
    sizes = {"upper": size, "split": size, "drop_odd": max(1, size // 2)}
    out = collect(pipe, runner=runner, num_workers=workers, microbatch_sizes=sizes)
    assert_same(ref, out)


def test_non_deterministic_mode_delivers_the_same_multiset() -> None:
    pipe = pipe_of(60).apply(Upper()).apply(Split())
    ref = collect(pipe, runner="inline")
    out = collect(pipe, runner="threads", num_workers=3, deterministic=False)
    assert sorted(texts(out)) == sorted(texts(ref))


def test_fan_out_children_keep_lineage_and_order() -> None:
    out = collect(pipe_of(10, num_lanes=1).apply(Split()), runner="inline")
    assert texts(out)[:4] == ["doc 0/a", "doc 0/b", "doc 1/a", "doc 1/b"]
    assert [r.meta.lineage for r in out[:2]] == [(0,), (1,)]


def test_tombstones_never_reach_the_caller_and_are_counted() -> None:
    pipe = pipe_of(40).apply(DropOdd())
    out = collect(pipe, runner="threads", num_workers=2)
    assert len(out) == 20 and all(_number(r) % 2 == 0 for r in out)
    stats = assert_conserved(pipe, runner="inline")
    assert stats["tombstoned"] == 20
    assert stats["lanes"][0]["tombstoned"] == {"odd": 4}  # docs 1, 3, 21, 23


def test_each_lane_is_the_same_on_any_number_of_ranks() -> None:
    pipe = pipe_of(70).apply(Split()).apply(DropOdd())
    assert_elastic(pipe, world_sizes=(1, 2, 4))


def test_fan_out_with_contributors_conserves_samples() -> None:
    stats = assert_conserved(pipe_of(30).apply(Split()), runner="inline")
    assert stats == {**stats, "read": 30, "delivered": 30, "tombstoned": 0}


def test_ranks_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    it = pipe_of().iter(runner="inline")
    assert (it.rank, it.world_size, it.lanes) == (1, 2, [1, 3])
    it.close()


def test_explicit_lanes_subset() -> None:
    out = collect(pipe_of(), runner="inline", lanes=[2])
    assert set(per_lane(out)) == {2}


def test_world_size_larger_than_num_lanes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="world_size 5 exceeds num_lanes 4"):
        pipe_of().iter(runner="inline", rank=0, world_size=5)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        pipe_of().iter(runner="inline", rank=2, world_size=2)


def test_microbatch_size_overrides_are_validated() -> None:
    pipe = pipe_of().apply(Upper()).apply(Upper())
    assert pipe.stage_names() == ["upper_1", "upper_2"]
    with pytest.raises(ValueError, match=r"'upper', which is not a stage.*upper_1"):
        pipe.iter(runner="inline", microbatch_sizes={"upper": 4})
    with pytest.raises(ValueError, match="positive integer"):
        pipe.iter(runner="inline", microbatch_sizes={"upper_1": 0})


def test_unsupported_element_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="Unsupported element type: dict"):
        collect(pipe_of().apply(ReturnsDicts()), runner="inline")


@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_a_raising_operator_raises_the_same_exception_type(runner: str) -> None:
    with pytest.raises(KeyError, match="doc 13"):
        collect(pipe_of().apply(Raises()), runner=runner, num_workers=2)


def test_a_reset_flush_that_leaves_data_is_a_loud_error() -> None:
    pipe = pipe_of(40, flush_every_k_chunks=1).apply(Leaky())
    with pytest.raises(RuntimeError, match="left pending data on lane 0"):
        collect(pipe, runner="inline")


def test_pointer_sources_need_fetch_first() -> None:
    pipe = Pipeline.from_sources([MemDataset(docs(4), access="pointer")]).apply(Upper())
    with pytest.raises(ValueError, match=r"add \.fetch\(\) before \.upper\(\)"):
        pipe.iter(runner="inline")


def test_apply_rejects_non_operators() -> None:
    with pytest.raises(TypeError, match="map_transform"):
        pipe_of().apply(lambda p: p)  # type: ignore[arg-type]


def test_flush_every_defaults_follow_the_plan() -> None:
    class Reorders(Operator):
        name = "reorders"

        def traits(self) -> OpTraits:
            return OpTraits(preserves_cursor_order=False)

    assert pipe_of().apply(Upper()).flush_every() == 0
    assert pipe_of().apply(Reorders()).flush_every() == 8
    assert pipe_of(flush_every_k_chunks=3).apply(Reorders()).flush_every() == 3


def test_source_configuration_is_validated() -> None:
    with pytest.raises(ValueError, match="num_lanes must be a positive integer, got 0"):
        pipe_of(num_lanes=0)
    with pytest.raises(ValueError, match="chunk_size"):
        pipe_of(chunk_size=-1)
    with pytest.raises(ValueError, match="flush_every_k_chunks"):
        pipe_of(flush_every_k_chunks=-2)
    with pytest.raises(ValueError, match="weights must be nonnegative"):
        Pipeline.from_sources([MemDataset(docs(3)), MemDataset(docs(3))], weights=[0, 0])
    with pytest.raises(ValueError, match="unknown runner"):
        pipe_of().iter(runner="gpu")
