"""The consumer's hand-over: interleaves of ready runs against one item at a time.

``PipelineIterator`` hands the runs at the heads of its lanes' queues out
through one round-robin list and counts what was taken in bulk
(``runners/iterator.py``). With ``_interleave_max = 1`` every item goes
through the slow path alone, which is the reference: the same items, the
same state after every item, the same books at the end, whatever the
pipeline (tombstones, sentinels, batches, user operators, ended lanes,
another rank's share) and wherever states are asked for.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from harness import assert_same, collect
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon_torch as zt
from zephon_torch.ops.base import Operator, OpTraits
from zephon_torch.pipeline import Pipeline
from zephon_torch.runners.iterator import PipelineIterator
from zephon_torch.types import ContributorRef, SampleRecord


class Rewrap(Operator):
    """A user operator without a block path: plain records come back as a list."""

    name = "rewrap"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        return [SampleRecord(e.meta, dict(e.payload)) for e in elems]


class Halves(Operator):
    """Fan-out into two tagged children, only the second closing its base sample."""

    name = "halves"

    def process_many(self, elems: Sequence[Any]) -> list[Any]:
        out = []
        for e in elems:
            base = e.meta.cursor
            first = e.meta.child(0).with_contributors([ContributorRef(base.child(0), False)])
            last = e.meta.child(1).with_contributors([ContributorRef(base.child(1), True)])
            out += [SampleRecord(first, e.payload), SampleRecord(last, e.payload)]
        return out

    def traits(self) -> OpTraits:
        return OpTraits(fan_out=True)


def _keep(payload: dict) -> bool:
    return len(payload["text"]) % 3 != 0


def _lengthen(payload: dict) -> dict:
    return {**payload, "n": len(payload["text"])}


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[Pipeline, dict[str, Any]]:
    n = draw(st.integers(0, 200))
    texts = [" " if draw(st.integers(0, 9)) == 0 else f"doc {i}" + "x" * (i % 5)
             for i in range(n)]
    num_lanes = draw(st.integers(1, 5))
    shuffle = draw(st.booleans())
    config: dict[str, Any] = {"num_lanes": num_lanes, "chunk_size": draw(
        st.one_of(st.integers(1, 9), st.integers(33, 45)))}  # runs counted as records, as rows
    if shuffle:
        config["flush_every_k_chunks"] = draw(st.integers(1, 3))
    pipe = zt.Pipeline.from_items(texts, **config)
    if draw(st.booleans()):
        pipe = pipe.filter(_keep)
    if draw(st.booleans()):
        pipe = pipe.map_transform(_lengthen)
    user = draw(st.sampled_from([None, "rewrap", "halves"]))
    if user == "rewrap":
        pipe = pipe.apply(Rewrap())
    elif user == "halves":
        pipe = pipe.apply(Halves())
    if shuffle:
        pipe = pipe.shuffle(draw(st.integers(2 * num_lanes, 12)), seed=draw(st.integers(0, 3)))
    if draw(st.booleans()):
        pipe = pipe.batch(draw(st.integers(1, 4)), drop_last=draw(st.booleans()))
    world_size = draw(st.integers(1, num_lanes))
    kwargs = {"runner": "inline", "rank": draw(st.integers(0, world_size - 1)),
              "world_size": world_size, "verify": True}
    return pipe, kwargs


def _run(pipe: Pipeline, kwargs: dict[str, Any], cuts: set[int] | None,
         one_at_a_time: bool) -> tuple[list[Any], dict[int, dict], dict[str, Any]]:
    """Items, the states after the items at ``cuts`` (None: every item), and the books."""
    it = pipe.iter(**kwargs)
    if one_at_a_time:
        it._interleave_max = 1
    items: list[Any] = []
    states: dict[int, dict] = {}
    try:
        if cuts is None or 0 in cuts:
            states[0] = it.state_dict()
        for item in it:
            items.append(item)
            if cuts is None or len(items) in cuts:
                states[len(items)] = it.state_dict()
        report = it.stats()
    finally:
        it.close()
    for key in ("throughput", "bytes_read"):
        report.pop(key, None)
    return items, states, report


@settings(max_examples=300, deadline=None)
@given(pipelines(), st.data())
def test_interleaves_hand_over_what_one_item_at_a_time_does(case: Any, data: Any) -> None:
    pipe, kwargs = case
    items, states, report = _run(pipe, kwargs, None, one_at_a_time=True)
    cuts = set(data.draw(st.lists(st.integers(0, len(items)), max_size=8)))
    fast_items, fast_states, fast_report = _run(pipe, kwargs, cuts, one_at_a_time=False)
    assert_same(items, fast_items, "interleaved")
    for cut, state in fast_states.items():
        assert state == states[cut], f"the state after {cut} items differs"
    assert fast_report == report
    plain_items, _, plain_report = _run(pipe, kwargs, set(), one_at_a_time=False)
    assert_same(items, plain_items, "without states")
    assert plain_report == report


@settings(max_examples=25, deadline=None)
@given(pipelines(), st.data())
def test_a_state_taken_inside_an_interleave_resumes_exactly(case: Any, data: Any) -> None:
    pipe, kwargs = case
    kwargs = {**kwargs, "verify": False}
    reference = collect(pipe, **kwargs)
    cut = data.draw(st.integers(0, len(reference)))
    with pipe.iter(**kwargs) as it:
        head = [next(it) for _ in range(cut)]
        state = json.loads(json.dumps(it.state_dict()))
    with pipe.iter(**kwargs) as resumed:
        resumed.load_state_dict(state)
        assert_same(reference, head + list(resumed), f"resumed after {cut}")


def test_one_interleave_spans_the_lanes_and_the_fast_path_takes_the_rest() -> None:
    pipe = zt.Pipeline.from_items([f"doc {i}" for i in range(64)], num_lanes=4, chunk_size=16)
    with pipe.iter(runner="inline") as it:
        first = next(it)
        plan = it._plan
        assert plan is not None and len(plan.served) == 1  # only lane 0 was pumped yet
        rest = list(it)
    assert [r.meta.lane_id for r in [first, *rest]][:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert_same(collect(pipe, runner="inline"), [first, *rest])


def test_records_handed_over_are_exact_records() -> None:
    pipe = zt.Pipeline.from_items([{"text": f"doc {i}"} for i in range(20)], num_lanes=2,
                                  chunk_size=4).map_transform(lambda p: p)
    with pipe.iter(runner="inline") as it:
        records = list(it)
    assert all(type(r) is SampleRecord and type(r.meta) is zt.SampleMeta for r in records)
    assert records[0] == SampleRecord(zt.SampleMeta((0, 0, 0), 0, 0, 0, {0: 1}),
                                      {"text": "doc 0"})


def test_a_state_from_another_thread_inside_interleaves_is_an_exact_position() -> None:
    # Plain records only: the caller takes them from interleaves without a lock.
    pipe = zt.Pipeline.from_items([f"doc {i}" for i in range(3000)], num_lanes=4,
                                  chunk_size=37).filter(_keep)
    reference = collect(pipe, runner="inline")
    states: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    taken = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            try:
                states.append(it.state_dict())
            except BaseException as exc:  # the test reports every failure
                errors.append(exc)
            taken.set()

    it = pipe.iter(runner="inline")
    thread = threading.Thread(target=hammer)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    thread.start()
    try:
        out = []
        for item in it:
            out.append(item)
            if len(out) % 150 == 0:  # a state at least this often, however busy the machine
                taken.clear()
                taken.wait(timeout=10)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
        it.close()
    assert not errors, repr(errors[0])
    assert_same(reference, out, "the iteration itself")
    positions = {sum(e["outputs"] for e in s["lanes"].values()): s for s in states}
    assert len(positions) > 3, sorted(positions)
    keys = sorted(positions)
    for position in {keys[round(i * (len(keys) - 1) / 5)] for i in range(6)}:
        with pipe.iter(runner="inline") as resumed:
            resumed.load_state_dict(json.loads(json.dumps(positions[position])))
            assert_same(reference[position:], list(resumed), f"resumed at {position}")


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_a_bounded_interleave_hands_over_the_same_items(limit: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = zt.Pipeline.from_items([f"doc {i}" for i in range(50)], num_lanes=3, chunk_size=5)
    reference = collect(pipe, runner="inline")
    monkeypatch.setattr(PipelineIterator, "_interleave_max", limit)
    assert_same(reference, collect(pipe, runner="inline"), f"at most {limit}")
